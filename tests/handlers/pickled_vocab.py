"""A vocabulary object pickled with torch.save (like a torchtext Vocab): needs weights_only=False."""


class WordIndex:
    def __init__(self, stoi):
        self.stoi = dict(stoi)

    def __getitem__(self, token):
        return self.stoi.get(token, 0)
