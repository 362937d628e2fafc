"""A small byte-level GPT: the model of examples/train_lm and of the
language-model cases of bench/run train_throughput (the same module runs
there under troupe and under plain PyTorch DDP).

`forward(batch)` is the train step troupe runs: it takes the batch of a
token-stream data set ({"input": [B, T] byte ids, "target": the next ones})
and returns the loss and the next-byte accuracy. `logits(idx)` is what
generation uses. TorchScript-able (torch.jit.script), so the C++ trainers
run it without Python."""
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (float(hd) ** -0.5)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, block_size: int = 128, width: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = self.logits(batch["input"])
        target = batch["target"]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        accuracy = (logits.argmax(-1) == target).float().mean()
        return {"loss": loss, "accuracy": accuracy.detach()}


@torch.no_grad()
def generate(model: TinyGPT, prompt: bytes, length: int, temperature: float = 0.8, top_k: int = 20,
             seed: int = 0) -> bytes:
    """Samples `length` bytes after `prompt` (eager model)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    model.eval()
    for _ in range(length):
        logits = model.logits(idx[:, -model.block_size:])[:, -1, :] / temperature
        kth = torch.topk(logits, top_k).values[:, -1:]
        probs = F.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
    return bytes(idx[0].tolist())
