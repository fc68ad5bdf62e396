"""Taylor linear attention's chunked form, O(n): exact within chunks, the running state (S, z) between them
(training and prompts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.ops.linear.feature_map import taylor_features, taylor_kernel


def chunked_linear_attention(q, k, v, state=None, chunk: int = 64, starts=None):
    """O(n) causal Taylor linear attention of q, k (B, H, n, d) and v (B, H, n, D).

    state: (S, z) with S (B, H, F, D) and z (B, H, F) summarising earlier tokens, or None. starts (B, n) bool:
    the tokens that begin a document, before which the state is zero; None: none. Returns the output and the
    state after the last token.
    """
    B, H, n, d = q.shape
    D = v.shape[-1]
    pad = -n % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    nc = (n + pad) // chunk
    qc, kc, vc = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    valid = (torch.arange(n + pad, device=q.device) < n).to(q.dtype).view(nc, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    writes = valid  # the keys that reach the state at the chunk's end: padded ones do not
    if starts is not None:
        runs = F.pad(starts, (0, pad)).view(B, 1, nc, chunk).cumsum(-1)  # equal within one document
        causal = causal & (runs.unsqueeze(-1) == runs.unsqueeze(-2))
        writes = valid * (runs == runs[..., -1:]).unsqueeze(-1)  # nor those before the chunk's last document
    phi_k = taylor_features(kc) * writes
    kv = phi_k.transpose(-1, -2) @ vc  # (B, H, nc, F, D): each chunk's contribution
    ksum = phi_k.sum(-2)  # (B, H, nc, F)
    S0 = torch.zeros(B, H, kv.shape[-2], D, dtype=q.dtype, device=q.device) if state is None else state[0]
    z0 = torch.zeros(B, H, ksum.shape[-1], dtype=q.dtype, device=q.device) if state is None else state[1]
    keeps = None
    if starts is not None:
        keeps = runs[:, 0, :, -1] == 0
        keeps[:, 0] |= state is None  # dropping a zero state changes nothing
    S_before, z_before, S_after, z_after = running_states(kv, ksum, S0, z0, keeps)
    phi_q = taylor_features(qc)
    within = taylor_kernel(qc, kc) * causal * valid.transpose(-1, -2)
    S_read, z_read = phi_q @ S_before, (phi_q @ z_before.unsqueeze(-1)).squeeze(-1)
    if starts is not None:  # the tokens before their chunk's first start alone read the state before it
        carry = (runs == 0).to(q.dtype)
        S_read, z_read = S_read * carry.unsqueeze(-1), z_read * carry
    numerator = within @ vc + S_read
    denominator = within.sum(-1) + z_read
    y = (numerator / denominator.unsqueeze(-1)).reshape(B, H, n + pad, D)[:, :, :n]
    return y, (S_after, z_after)


def running_states(kv, ksum, S0, z0, keeps=None):
    """The states S, z at the start of every chunk and after the last one: S0, z0 (B, H, F, D), (B, H, F) plus the
    contributions kv (B, H, nc, F, D), ksum (B, H, nc, F) of the chunks before. keeps (B, nc) bool: whether a
    chunk hands on the state it began with (not where a document starts inside it: its own contribution alone
    goes on); None: every chunk does. Rows that drop no state get the running sums' bits, as without documents."""
    def running_sums(kv, ksum, S0, z0):
        S_before = S0.unsqueeze(2) + kv.cumsum(2) - kv
        z_before = z0.unsqueeze(2) + ksum.cumsum(2) - ksum
        return S_before, z_before, S_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + ksum[:, :, -1]

    unbroken = None if keeps is None else keeps.all(1)  # the rows that drop no state
    host = not simulate_cuda.gpu_path(kv.device)  # where asking the data costs no synchronisation
    if keeps is None or (host and unbroken.all()):
        return running_sums(kv, ksum, S0, z0)
    # a cumsum cannot restart, a scan over chunks can (on the CPU it is also faster: cumsum sums in float64)
    S, z, befores = S0, z0, []
    for kv_c, ksum_c, keep in zip(kv.unbind(2), ksum.unbind(2), keeps.unbind(1)):
        befores.append((S, z))
        S = torch.where(keep[:, None, None, None], S, 0) + kv_c
        z = torch.where(keep[:, None, None], z, 0) + ksum_c
    scanned = torch.stack([b[0] for b in befores], 2), torch.stack([b[1] for b in befores], 2), S, z
    if not host:  # every row's running sums too, and each row takes its own
        return tuple(torch.where(unbroken.view(-1, *(1,) * (a.dim() - 1)), a, b)
                     for a, b in zip(running_sums(kv, ksum, S0, z0), scanned))
    rows = unbroken.nonzero().flatten()  # the host picks the rows, whose running sums alone are made
    if not len(rows):
        return scanned
    sums = running_sums(kv[rows], ksum[rows], S0[rows], z0[rows])
    return tuple(b.index_put((rows,), a) for a, b in zip(sums, scanned))
