"""A --model-file with two nn.Module classes: loading must fail and say so."""
import torch


class First(torch.nn.Module):
    def forward(self, x):
        return x


class Second(torch.nn.Module):
    def forward(self, x):
        return x
