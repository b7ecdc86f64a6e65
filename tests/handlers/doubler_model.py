"""Eager model for the BaseHandler test: y = 2x through a Linear layer."""
import torch


class Doubler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2, bias=False)

    def forward(self, x):
        return self.linear(x)
