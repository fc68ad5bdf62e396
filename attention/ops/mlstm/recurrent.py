"""The mLSTM's recurrent form: one token at a time from the state (C, n, m), constant memory: generation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.ops.mlstm.naive import EPS, zero_state


def recurrent_mlstm(q, k, v, i, f, state=None, eps: float = EPS, starts=None):
    """Token by token: the generation form. starts (B, n) bool: the tokens that begin a document, where the state
    restarts from zero; None: none. Returns h (B, H, n, d_v) and the state (C, n, m) after the last token."""
    C, n, m = zero_state(q, v) if state is None else state
    scale = q.shape[-1] ** -0.5
    outputs = []
    for t in range(q.shape[2]):
        if starts is not None:
            keep = ~starts[:, t, None, None]  # (B, 1, 1)
            C, n, m = torch.where(keep[..., None], C, 0), torch.where(keep, n, 0), torch.where(keep, m, 0)
        log_f, i_t = F.logsigmoid(f[:, :, t, None]), i[:, :, t, None]
        m_new = torch.maximum(log_f + m, i_t)
        decay, gain = torch.exp(log_f + m - m_new), torch.exp(i_t - m_new)
        k_t, q_t = k[:, :, t], q[:, :, t] * scale
        C = decay[..., None] * C + gain[..., None] * (k_t[..., :, None] * v[:, :, t, None, :])
        n = decay * n + gain * k_t
        m = m_new
        qn = (q_t * n).sum(-1, keepdim=True)
        outputs.append((q_t[..., None, :] @ C).squeeze(-2) / (torch.maximum(qn.abs(), torch.exp(-m)) + eps))
    return torch.stack(outputs, dim=2), (C, n, m)

