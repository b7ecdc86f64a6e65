"""Text-classifier test model: TorchServe's AG_NEWS example shape, model(text, offsets)."""
import torch


class SentimentModel(torch.nn.Module):
    def __init__(self, vocab_size=12, embed_dim=2, num_class=2):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(vocab_size, embed_dim, mode="sum")
        self.fc = torch.nn.Linear(embed_dim, num_class)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))
