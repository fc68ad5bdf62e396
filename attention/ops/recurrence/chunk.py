"""The recurrence's chunked form, O(n): the parallel form inside chunks of `chunk` tokens, the state between them
(training and prompts; the recurrence is stated in attention/ops/recurrence/__init__.py).

Inside a chunk that starts from state S, with G_t the log decay summed from the chunk's start (from the token's
document's start where one lies in the chunk), the state after token t is
    S_t = exp(G_t) S + sum_{j <= t} exp(G_t - G_j) phi(k_j)^T u_j
with u_j = w_j v_j; for the delta rule u_j = delta_j = beta_j (v_j - phi(k_j) exp(G_j) S_{j-1}), and substituting
S_{j-1} gives the unit lower-triangular system (I + A) delta = beta v - beta exp(G) phi(k) S with
A_ij = beta_i phi(k_i) . phi(k_j) exp(G_i - G_j), j < i. With T = (I + A)^-1 (one triangular solve per chunk),
u = T (beta v) and w = T (beta exp(G) phi(k)) depend on the chunk alone (the WY form), so only
    delta = u - w S,   y = (phi(q) exp(G)) S + tril(phi(q) . phi(k) exp(G_i - G_j)) delta,
    S <- exp(G_C) S + (phi(k) exp(G_C - G))^T delta
runs sequentially over chunks; without the delta rule w = 0 and every chunk's reads are one batched product. A
stabilised recurrence (exponential gains) does the same in log space, each read and each chunk's contribution
scaled by its largest log weight.

Packed documents (starts) are exact masks of the same algebra: G counts from each token's document's start (no
document's gates reach another's tokens, in value or gradient), a token after a document's start in its chunk
reads no S and no earlier key of the chunk (weights across documents are zero, never exp of a forced -inf), and
the state carried out of a chunk holding a start is its last document's alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.documents import document_cumsum
from attention.ops.recurrence.gates import IDENTITY, NO_INPUT, FeatureMap, Gates, State, zero_state


def chunked_recurrence(q, k, v, gates: Gates = Gates(), state: State | None = None, chunk: int = 64, starts=None,
                       features: FeatureMap = IDENTITY):
    """The reads phi(q_t) S_t of q, k (B, H, n, d_k), v (B, H, n, d_v) under gates (B, H, n) each, from state
    (None: zero). starts (B, n) bool: the tokens that begin a document, before which the state is zero; None:
    none. Returns the reads (B, H, n, d_v), m_t (B, H, n) of a stabilised recurrence (else None) and the state after
    the last token. Memory is O(n * chunk)."""
    B, H, n, _ = q.shape
    pad = -n % chunk
    log_decay, log_gain, beta = gates.log_decay, gates.log_gain, gates.beta
    if gates.stabilised and log_gain is None:
        log_gain = torch.zeros(q.shape[:3], dtype=q.dtype, device=q.device)
    if pad:  # padding neither decays the state (log a = 0) nor writes into it
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        log_decay = None if log_decay is None else F.pad(log_decay, (0, pad))
        log_gain = None if log_gain is None else F.pad(log_gain, (0, pad), value=NO_INPUT)
        beta = None if beta is None else F.pad(beta, (0, pad))
    nc = (n + pad) // chunk
    qc, kc, vc = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    by_chunk = lambda t: None if t is None else t.reshape(B, H, nc, chunk)  # noqa: E731
    log_decay, log_gain, beta = by_chunk(log_decay), by_chunk(log_gain), by_chunk(beta)
    S0 = zero_state(features.dim(k), v, gates.stabilised) if state is None else state
    zero_start = state is None

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    runs = None
    if starts is not None:
        starts = F.pad(starts, (0, pad)).view(B, 1, nc, chunk)
        runs = starts.cumsum(-1)  # equal within one document
        causal = causal & (runs.unsqueeze(-1) == runs.unsqueeze(-2))
    if log_decay is None:
        G = None
    else:
        G = log_decay.cumsum(-1) if starts is None else document_cumsum(log_decay, starts)
    args = (qc, kc, vc, G, log_gain, causal, runs, S0, features)
    if gates.stabilised:
        reads, m, final = _stabilised(*args)
    else:
        written = None
        if pad and log_gain is None and beta is None:  # nothing else keeps padded keys out of the state
            written = (torch.arange(n + pad, device=q.device) < n).to(q.dtype).view(nc, chunk)
        reads, final = _plain(*args, beta, written, zero_start)
        m = None
    reads = reads.reshape(B, H, nc * chunk, -1)[:, :, :n]
    return reads, (None if m is None else m.reshape(B, H, nc * chunk)[:, :, :n]), final


def masked(values, mask):
    """values where mask holds, else 0; all of them without a mask (None)."""
    return values if mask is None else values * mask


def _plain(qc, kc, vc, G, log_gain, causal, runs, S0, features, beta, written, zero_start):
    """Chunks of an unstabilised recurrence (linear attention, the delta rule): weights exp(G_i - G_j) w_j."""
    carry = live = None
    if runs is not None:  # S reaches the tokens before the chunk's first start; only its last document its end
        carry, live = runs == 0, runs == runs[..., -1:]
    if G is None:
        decay = causal.to(qc.dtype)
        q_read = masked(features.features(qc), None if carry is None else carry.unsqueeze(-1))
        k_weight = live
        chunk_decay = None if carry is None else carry[..., -1].to(qc.dtype)
    else:
        # exp only below the diagonal: above it G_i - G_j > 0 and could overflow, and inf * 0 would poison grads
        decay = torch.where(causal, G.unsqueeze(-1) - G.unsqueeze(-2), float("-inf")).exp()
        q_read = features.features(qc) * masked(G.exp(), carry).unsqueeze(-1)
        k_weight = masked((G[..., -1:] - G).exp(), live)
        chunk_decay = masked(G[..., -1].exp(), None if carry is None else carry[..., -1])
    phi_k = features.features(kc)
    if beta is not None:
        # I + A is unit lower triangular: with unitriangular the solver takes the diagonal as 1 and reads only
        # the strict lower triangle of A, so A needs no further masking
        A = (beta.unsqueeze(-1) * phi_k) @ phi_k.transpose(-1, -2) * decay
        initial = masked(beta, carry) if G is None else beta * masked(G.exp(), carry)
        rhs = torch.cat([beta.unsqueeze(-1) * vc, initial.unsqueeze(-1) * phi_k], dim=-1)
        uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        u, w = uw[..., :vc.shape[-1]], uw[..., vc.shape[-1]:]
    else:
        u, w = vc, None
        weight = written if log_gain is None else log_gain.exp()
        if weight is not None:
            decay = decay * weight.unsqueeze(-2)
            k_weight = weight if k_weight is None else k_weight * weight
    within = features.kernel(qc, kc) * decay
    k_write = masked(phi_k, None if k_weight is None else k_weight.unsqueeze(-1))
    if chunk_decay is not None:
        chunk_decay = chunk_decay[..., None, None]
    S = S0.S
    if w is None:
        contributions = k_write.transpose(-1, -2) @ u  # (B, H, nc, F, D): each chunk's write at its end
        if G is None:  # nothing decays: running sums, except where a document drops the state
            keeps = None if carry is None else carry[:, 0, :, -1].clone()  # (B, nc)
            if keeps is not None and zero_start:
                keeps[:, 0] = True  # dropping a zero state changes nothing
            S_before, final = running_states(contributions, S, keeps)
        else:
            befores = []
            # unbound once: indexing chunk c inside the loop would give each step a backward the size of the whole
            # sequence (O(n^2) in all)
            for contribution, decay_c in zip(contributions.unbind(2), chunk_decay.unbind(2)):
                befores.append(S)
                S = decay_c * S + contribution
            S_before, final = torch.stack(befores, dim=2), S
        return within @ u + q_read @ S_before, State(final)
    outputs = []
    decays = [None] * qc.shape[2] if chunk_decay is None else chunk_decay.unbind(2)
    for u_c, w_c, q_c, within_c, k_c, decay_c in zip(u.unbind(2), w.unbind(2), q_read.unbind(2), within.unbind(2),
                                                     k_write.unbind(2), decays):
        delta = u_c - w_c @ S
        outputs.append(q_c @ S + within_c @ delta)
        S = (S if decay_c is None else decay_c * S) + k_c.transpose(-1, -2) @ delta
    return torch.stack(outputs, dim=2), State(S)


def running_states(contributions, S0, keeps=None):
    """The states at the start of every chunk and after the last one: S0 (B, H, F, D) plus the contributions
    (B, H, nc, F, D) of the chunks before. keeps (B, nc) bool: whether a chunk hands on the state it began with (not
    where a document starts inside it: its own contribution alone goes on); None: every chunk does. Rows that drop
    no state get the running sums' bits, as without documents."""
    def running_sums(contributions, S0):
        before = S0.unsqueeze(2) + contributions.cumsum(2) - contributions
        return before, before[:, :, -1] + contributions[:, :, -1]

    unbroken = None if keeps is None else keeps.all(1)  # the rows that drop no state
    host = not simulate_cuda.gpu_path(contributions.device)  # where asking the data costs no synchronisation
    if keeps is None or (host and unbroken.all()):
        return running_sums(contributions, S0)
    # a cumsum cannot restart, a scan over chunks can (on the CPU it is also faster: cumsum sums in float64)
    S, befores = S0, []
    for contribution, keep in zip(contributions.unbind(2), keeps.unbind(1)):
        befores.append(S)
        S = torch.where(keep[:, None, None, None], S, 0) + contribution
    scanned = torch.stack(befores, 2), S
    if not host:  # every row's running sums too, and each row takes its own
        return tuple(torch.where(unbroken.view(-1, *(1,) * (a.dim() - 1)), a, b)
                     for a, b in zip(running_sums(contributions, S0), scanned))
    rows = unbroken.nonzero().flatten()  # the host picks the rows, whose running sums alone are made
    if not len(rows):
        return scanned
    sums = running_sums(contributions[rows], S0[rows])
    return tuple(b.index_put((rows,), a) for a, b in zip(sums, scanned))


def _stabilised(qc, kc, vc, G, log_gain, causal, runs, S0, features):
    """Chunks of a stabilised recurrence (the mLSTM's exponential input gates): every weight exp(G_i - G_j + log w_j)
    taken relative to the largest one, the state carried divided by exp(m)."""
    B, H, nc, L, _ = qc.shape
    if G is None:
        G = torch.zeros(B, H, nc, L, dtype=qc.dtype, device=qc.device)
    keeps = [None] * nc
    carry = None
    if runs is not None:
        carry = runs == 0  # the tokens the state before the chunk reaches
        keeps = carry[..., -1:].to(qc.dtype).unbind(2)
    total = G[..., -1]  # (B, H, nc): a chunk's whole decay (its last document's, from its start)
    # each chunk's own contribution to the state at its end, stabilised by its largest log weight g
    log_to_end = total[..., None] - G + log_gain  # b_L - b_j + i_j
    if runs is not None:
        log_to_end = torch.where(runs == runs[..., -1:], log_to_end, -torch.inf)
    # max().values, not amax(): amax's backward divides by the number of ties, which inductor recomputes in
    # backward and can find 0 of (NaN gate gradients from bf16 gates under autocast); max's goes to one index
    g = log_to_end.max(-1).values
    phi_k = features.features(kc)
    to_end = torch.exp(log_to_end - g[..., None])[..., None] * phi_k  # (B, H, nc, L, F)
    chunk_S = to_end.transpose(-1, -2) @ vc

    # the scan over chunks: states before each chunk (S, m), as the recurrence would have them. The inputs are
    # unbound once: indexing chunk c inside the loop would give each step a backward the size of the whole sequence
    S, m = S0
    states = []
    for chunk_total, chunk_max, contribution, keep in zip(total.unsqueeze(-1).unbind(2), g.unsqueeze(-1).unbind(2),
                                                          chunk_S.unbind(2), keeps):
        states.append((S, m))
        if keep is not None:  # 0 where a document starts in the chunk: the state before it is dropped, m = 0
            m = torch.where(keep > 0, m, 0)
        m_new = torch.maximum(chunk_total + m, chunk_max)
        decay, gain = torch.exp(chunk_total + m - m_new), torch.exp(chunk_max - m_new)
        if keep is not None:
            decay = decay * keep
        S = decay[..., None] * S + gain[..., None] * contribution
        m = m_new
    S_before = torch.stack([s[0] for s in states], dim=2)  # (B, H, nc, F, D)
    m_before = torch.stack([s[1] for s in states], dim=2)  # (B, H, nc, 1)

    log_weights = torch.where(causal, G[..., :, None] - G[..., None, :] + log_gain[..., None, :], -torch.inf)
    log_initial = G + m_before if carry is None else G + torch.where(carry, m_before, 0)
    m_t = torch.maximum(log_weights.max(-1).values, log_initial)  # (max, not amax: see g above)
    weights = torch.exp(log_weights - m_t[..., None]) * features.kernel(qc, kc)
    initial = torch.exp(log_initial - m_t)[..., None]
    if carry is not None:
        initial = initial * carry[..., None]
    reads = weights @ vc + initial * (features.features(qc) @ S_before)
    return reads, m_t, State(S, m)
