"""Scratch: correctness + benchmark for attnkit.backends._decode_kernel.grouped_decode (CPU).

python benchmarks/_scratch_decode.py [check|bench|all]
"""
import sys, time, statistics
import torch
import torch.nn.functional as F
from attnkit.backends._decode_kernel import grouped_decode


def ref64(q, k, v, scale, bias):
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]; G = Hq // Hkv
    kr = k.double().repeat_interleave(G, 1); vr = v.double().repeat_interleave(G, 1)
    s = q.double() @ kr.transpose(-1, -2) * scale
    if bias is not None:
        bb = bias.double().expand(B, Hkv, G, Sq, k.shape[2]).reshape(B, Hq, Sq, k.shape[2])
        s = s + bb
    ok = s.amax(-1, keepdim=True) > float("-inf")
    p = torch.softmax(s.masked_fill(~ok, 0), -1).masked_fill(~ok, 0)
    return p @ vr


def eager(q, k, v, scale, bias):
    """Plain eager baseline: grouped scores in input dtype, softmax fp32, P rounded to input dtype."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]; G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * Sq, D)
    s = (qg @ k.transpose(-1, -2)).float() * scale
    if bias is not None:
        s = (s.view(B, Hkv, G, Sq, -1) + bias).view(B, Hkv, G * Sq, -1)
    ok = s.amax(-1, keepdim=True) > float("-inf")
    p = torch.softmax(s.masked_fill(~ok, 0), -1).masked_fill(~ok, 0)
    return (p.to(q.dtype) @ v).reshape(B, Hq, Sq, -1)


def check():
    torch.manual_seed(0)
    worst = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for (Hq, Hkv) in ((8, 8), (32, 8), (32, 1)):
            for Sq in (1, 4):
                for Sk, noncontig, use_bias in ((37, False, True), (3000, True, True), (20000, True, False), (20000, False, True)):
                    B, D, Dv = (1 if Hkv == 1 else 2), 64, 48  # B*Hkv=1 exercises the context split
                    q = torch.randn(B, Hq, Sq, D, dtype=dt)
                    if noncontig:  # slice of a preallocated cache along Sk
                        kc = torch.randn(B, Hkv, Sk + 100, D, dtype=dt); vc = torch.randn(B, Hkv, Sk + 100, Dv, dtype=dt)
                        k, v = kc[:, :, :Sk], vc[:, :, :Sk]
                    else:
                        k = torch.randn(B, Hkv, Sk, D, dtype=dt); v = torch.randn(B, Hkv, Sk, Dv, dtype=dt)
                    G = Hq // Hkv
                    bias = None
                    if use_bias:
                        bias = torch.where(torch.rand(B, 1, 1, Sq, Sk) < 0.3, float("-inf"), 0.0)
                        bias[0, 0, 0, 0] = float("-inf")  # a fully -inf row (all groups)
                        bias = bias + torch.randn(1, Hkv, G, 1, 1)  # per-group offset, finite
                    scale = D ** -0.5
                    out = grouped_decode(q, k, v, scale, bias)
                    assert out.shape == (B, Hq, Sq, Dv) and out.dtype == dt
                    r = ref64(q, k, v, scale, bias)
                    e_ours = (out.double() - r).abs().max().item()
                    e_eag = (eager(q, k, v, scale, bias).double() - r).abs().max().item()
                    assert not torch.isnan(out).any()
                    if use_bias:
                        assert (out[0, :, 0] == 0).all(), "fully masked row must be exactly 0"
                    ok = e_ours <= max(2 * e_eag, 1e-6)
                    worst.append((dt, Hq, Hkv, Sq, Sk, noncontig, use_bias, e_ours, e_eag, ok))
                    print(f"{str(dt):15s} Hq={Hq:2d} Hkv={Hkv} Sq={Sq} Sk={Sk:5d} nc={int(noncontig)} bias={int(use_bias)} "
                          f"ours={e_ours:.2e} eager={e_eag:.2e} {'OK' if ok else 'FAIL'}", flush=True)
    # autograd path
    q = torch.randn(1, 8, 2, 32, requires_grad=True); k = torch.randn(1, 2, 50, 32, requires_grad=True)
    v = torch.randn(1, 2, 50, 32, requires_grad=True)
    bias = torch.zeros(1, 1, 1, 2, 50); bias[..., 1, :] = float("-inf")
    out = grouped_decode(q, k, v, 0.2, bias); out.sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref64(qd, kd, vd, 0.2, bias).sum().backward()
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert torch.isfinite(a.grad).all() and (a.grad.double() - b.grad).abs().max() < 1e-4
    print("autograd OK")
    assert all(w[-1] for w in worst), "some cases exceed 2x eager error"
    print("all correctness checks passed")


def median_ms(f, n, warm=2):
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def bench(rounds=5):
    B, Hq, Hkv, D, Sq = 1, 32, 8, 128, 1
    big = torch.randn(512 * 2**20 // 4)  # 512 MiB fp32, well past L3
    rows = []
    for Sk in (4096, 32768):
        for dt in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            q = torch.randn(B, Hq, Sq, D, dtype=dt)
            k = torch.randn(B, Hkv, Sk, D, dtype=dt); v = torch.randn(B, Hkv, Sk, D, dtype=dt)
            scale = D ** -0.5
            nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
            n_sdpa = 3 if Sk > 8192 else 10
            n_ours = 30 if Sk > 8192 else 100
            sd, ou, bw = [], [], []
            for _ in range(rounds):  # interleave so background load hits all three alike
                sd.append(median_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), n_sdpa, 1))
                ou.append(median_ms(lambda: grouped_decode(q, k, v, scale), n_ours))
                bw.append(big.numel() * 4 / (median_ms(lambda: big.sum(), 5, 1) / 1e3) / 1e9)
            s, o, b = statistics.median(sd), statistics.median(ou), statistics.median(bw)
            ref = ref64(q, k, v, scale, None)
            e_o = (grouped_decode(q, k, v, scale).double() - ref).abs().max().item()
            e_s = (F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).double() - ref).abs().max().item()
            gbs = nbytes / (o / 1e3) / 1e9
            rows.append((Sk, str(dt).split(".")[1], s, o, s / o, gbs, b, gbs / b, e_o, e_s))
            print(f"Sk={Sk:6d} {str(dt):15s} sdpa {s:8.2f} ms  ours {o:7.2f} ms  x{s/o:6.1f}  "
                  f"{gbs:6.2f} GB/s  machine {b:6.2f} GB/s ({100*gbs/b:4.0f}%)  err ours {e_o:.1e} sdpa {e_s:.1e}", flush=True)
    print("\n| Sk | dtype | SDPA ms | ours ms | speedup | ours GB/s | machine GB/s (big.sum) | % of machine | max err ours | max err SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.1f}x | {r[5]:.2f} | {r[6]:.2f} | {100*r[7]:.0f}% | {r[8]:.1e} | {r[9]:.1e} |")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("check", "all"):
        check()
    if what in ("bench", "all"):
        bench()
