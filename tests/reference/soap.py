"""A plain, per-tensor SOAP (Vyas et al. 2024) as its reference implementation computes it,
the oracle of tests/core/test_soap.py: one loop per parameter, explicit eigh / QR, no
cond, no batching. Written from the paper's Algorithm 1 and the behaviour of
github.com/nikhilvyas/SOAP's `SOAP.step` (commit f42d296): the first step only sets the
eigenbasis up; Adam's moments live in the eigenbasis; weight decay acts on the updated
parameter; every `freq` steps one power-iteration step + QR refreshes the basis, the second
moment re-sorted to the new column order and the first moment rotated into it.
"""

from __future__ import annotations

import torch


def _merge(shape, limit):
    out, run = [], 1
    for size in shape:
        if run * size > limit:
            if run > 1:
                out.append(run)
                run = size
            else:
                out.append(size)
                run = 1
        else:
            run *= size
    if run > 1 or not out:
        out.append(run)
    return out


class ReferenceSOAP:
    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=None, eps=1e-8, weight_decay=0.01, freq=10,
                 max_dim=10000, merge_dims=False, precondition_1d=False, normalize_grads=False, correct_bias=True):
        self.params = params
        self.lr, self.b1, self.b2, self.eps, self.wd, self.freq = lr, betas[0], betas[1], eps, weight_decay, freq
        self.sb = betas[1] if shampoo_beta is None else shampoo_beta
        self.max_dim, self.merge, self.pre1d, self.normalize, self.bias = max_dim, merge_dims, precondition_1d, normalize_grads, correct_bias
        self.state = {}

    def _view(self, x):
        return x.reshape(_merge(x.shape, self.max_dim)) if self.merge and x.dim() > 1 else x

    def _rotate(self, x, qs, back):
        shape = x.shape
        x = self._view(x)
        for q in qs:
            if q is None:
                x = x.permute(*range(1, x.dim()), 0)
            else:
                x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
        return x.reshape(shape)

    def _accumulate(self, st, g):
        g = self._view(g)
        for i, f in enumerate(st["L"]):
            if f is None:
                continue
            others = [d for d in range(g.dim()) if d != i]
            st["L"][i] = f.lerp(torch.tensordot(g, g, dims=(others, others)), 1 - self.sb)  # as the reference: lerp_

    def step(self):
        for p in self.params:
            g = p.grad
            st = self.state.setdefault(id(p), {})
            if not st:
                st["t"], st["m"], st["v"] = 0, torch.zeros_like(g), torch.zeros_like(g)
                shape = self._view(g).shape
                use = g.dim() > 1 or self.pre1d
                st["L"] = [torch.zeros(d, d, dtype=g.dtype) if use and d <= self.max_dim else None for d in shape]
                self._accumulate(st, g)
                st["Q"] = [None if f is None else torch.linalg.eigh(f + 1e-30 * torch.eye(f.shape[0], dtype=f.dtype))[1].flip(1)
                           for f in st["L"]]
                continue
            st["t"] += 1
            t = st["t"]
            gp = self._rotate(g, st["Q"], back=False)
            st["m"] = self.b1 * st["m"] + (1 - self.b1) * gp
            st["v"] = self.b2 * st["v"] + (1 - self.b2) * gp * gp
            d = self._rotate(st["m"] / (st["v"].sqrt() + self.eps), st["Q"], back=True)
            if self.normalize:
                d = d / (1e-30 + (d * d).mean().sqrt())
            size = self.lr * ((1 - self.b2**t) ** 0.5 / (1 - self.b1**t) if self.bias else 1.0)
            with torch.no_grad():
                p.sub_(size * d)
                p.sub_(self.lr * self.wd * p)
            m_plain = self._rotate(st["m"], st["Q"], back=True)
            self._accumulate(st, g)
            if t % self.freq == 0:
                v = self._view(st["v"])
                new_q = []
                for i, (f, q) in enumerate(zip(st["L"], st["Q"])):
                    if f is None:
                        new_q.append(None)
                        continue
                    order = torch.argsort(torch.diag(q.T @ f @ q), descending=True)
                    v = v.index_select(i, order)
                    new_q.append(torch.linalg.qr(f @ q[:, order])[0])
                st["v"], st["Q"] = v.reshape(st["v"].shape), new_q
            st["m"] = self._rotate(m_plain, st["Q"], back=False)
