"""Gated DeltaNet's chunked form, O(n): the WY form, exact within chunks of C tokens, the state between them (training
and prompts; the gated delta rule is stated in attention/gated_deltanet.py, the layer).

Inside a chunk starting from state S, let G_i be the cumulative log decay up to position i
and delta_j = beta_j (v_j - k_j exp(g_j) S_{j-1}) the correction written at j. Unrolling the recurrence,
    S_i = exp(G_i) S + sum_{j<=i} exp(G_i - G_j) k_j^T delta_j
and substituting S_{j-1} into delta_j gives a unit lower-triangular system (I + A) delta = beta v - beta exp(G) k S
with A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i. With T = (I + A)^-1 (one triangular solve per chunk),
u = T (beta v) and w = T (beta exp(G) k) depend on the chunk alone, so only
    delta = u - w S,   o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) delta,
    S <- exp(G_C) S + (k exp(G_C - G))^T delta
runs sequentially over chunks.

Packed documents (starts) are exact masks of the same algebra: G counts from each token's document's start (no
document's g reaches another's tokens, in value or gradient), a token after a document's start in its chunk
reads no S (its exp(G) factors are zeroed) and no earlier key of the chunk (exp(G_i - G_j) across documents is
zero, never exp of a forced -inf), and the state carried out of a chunk holding a start is its last
document's alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.documents import document_cumsum


def chunked_gated_delta_rule(q, k, v, g, beta, state=None, chunk: int = 64, starts=None):
    """O(n) gated delta rule of q, k (B, H, n, d), v (B, H, n, D), g and beta (B, H, n).

    q is used as given (normalise and scale it first); g is the log decay. state: (B, H, d, D) or None for
    zeros. starts (B, n) bool: the tokens that begin a document, before which the state is zero; None: none.
    Returns the output (B, H, n, D) and the state after the last token.
    """
    B, H, n, d = q.shape
    D = v.shape[-1]
    S = q.new_zeros(B, H, d, D) if state is None else state
    pad = -n % chunk
    if pad:
        # g = 0 and beta = 0 leave the state exactly as it was: padding neither decays nor writes
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    nc = (n + pad) // chunk
    q, k, v = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, nc, chunk), beta.reshape(B, H, nc, chunk)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    carry = live = None
    if starts is None:
        G = g.cumsum(-1)
    else:
        starts = F.pad(starts, (0, pad)).view(B, 1, nc, chunk)
        G = document_cumsum(g, starts)  # from the token's document's start: no document reaches another's g
        runs = starts.cumsum(-1)  # equal within one document
        causal = causal & (runs.unsqueeze(-1) == runs.unsqueeze(-2))
        # S reaches the tokens before the chunk's first start; only its last document reaches its end
        carry, live = runs == 0, runs == runs[..., -1:]
    # exp only below the diagonal: above it G_i - G_j > 0 and could overflow, and inf * 0 would poison grads
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)
    decay = torch.where(causal, diff, float("-inf")).exp()  # (B, H, nc, C, C), includes the diagonal
    A = (beta.unsqueeze(-1) * k) @ k.transpose(-1, -2) * decay
    # I + A is unit lower triangular: with unitriangular the solver takes the diagonal as 1 and reads only
    # the strict lower triangle of A, so A needs no further masking
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * masked(G.exp(), carry)).unsqueeze(-1) * k], dim=-1)
    uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :D], uw[..., D:]
    q_decayed = q * masked(G.exp(), carry).unsqueeze(-1)
    within = q @ k.transpose(-1, -2) * decay
    k_decayed = k * masked((G[..., -1:] - G).exp(), live).unsqueeze(-1)
    chunk_decay = masked(G[..., -1].exp(), None if carry is None else carry[..., -1])  # (B, H, nc)

    outputs = []
    # unbound once: indexing chunk c inside the loop would give each step a backward the size of the whole
    # sequence (O(n^2) in all)
    steps = zip(u.unbind(2), w.unbind(2), q_decayed.unbind(2), within.unbind(2), k_decayed.unbind(2),
                chunk_decay[..., None, None].unbind(2))
    for u_c, w_c, q_c, within_c, k_c, decay_c in steps:
        delta = u_c - w_c @ S
        outputs.append(q_c @ S + within_c @ delta)
        S = decay_c * S + k_c.transpose(-1, -2) @ delta
    y = torch.stack(outputs, dim=2).reshape(B, H, nc * chunk, D)[:, :, :n]
    return y, S


def masked(values, mask):
    """values where mask holds, else 0; all of them without a mask (None)."""
    return values if mask is None else values * mask
