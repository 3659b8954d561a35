"""Placeholder until the tuned kernel lands: grouped matmuls, fp32 softmax."""
import torch


def grouped_decode(q, k, v, scale, bias=None):
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, Sq, D)
    s = torch.matmul(qg.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    ok = s.amax(-1, keepdim=True) > float("-inf")
    p = torch.softmax(s.masked_fill(~ok, 0), -1).masked_fill(~ok, 0)
    return torch.matmul(p, v.float().unsqueeze(2)).reshape(B, Hq, Sq, -1).to(q.dtype)
