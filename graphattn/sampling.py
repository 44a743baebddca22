"""On-device sampling with per-request parameters held in static per-slot buffers.

One captured graph serves any mix of greedy and sampled requests: the parameters are read
from device buffers indexed by slot, never from Python. A seeded request draws its noise
from a counter-based hash of (seed, position, token id) instead of a generator, so it samples
the same tokens on replay and eager, on any device, whatever else ran in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphattn.checks import as_index

__all__ = ["SamplingParams", "SamplingTable", "greedy_tokens", "hash_uniform",
           "rejection_sample"]

_M1, _M2, _M3 = -7046029254386353131, -4658895280553007687, 7640891576956012809
_MASK53 = (1 << 53) - 1
# seeded draws of different purposes at one position use disjoint hash counters
DRAFT_SALT = 1 << 40
ACCEPT_SALT = 2 << 40
RESIDUAL_SALT = 3 << 40


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximum; a NaN counts as the maximum) in two stages
    for a large vocabulary: each of many chunks of the row reduced first, then the chunks'
    winners. A single-row argmax over 128K entries otherwise runs as one program per row.

    Parameters
    ----------
    logits : [B, V]

    Returns
    -------
    torch.Tensor
        int64 [B].
    """
    b, v = logits.shape
    c = _argmax_chunk(v)
    if not c:
        return logits.argmax(-1)
    x = logits.view(b, v // c, c)
    idx = x.argmax(-1)  # [B, chunks]: each chunk's first maximum
    best = x.gather(-1, idx[..., None])[..., 0].argmax(-1, keepdim=True)  # first best chunk
    return best[:, 0] * c + idx.gather(-1, best)[:, 0]


def _argmax_chunk(vocab: int) -> int:
    """A divisor of `vocab` that cuts it into 32 to 512 chunks of at least 256 entries (the
    smallest such chunk), or 0: reduce in one stage (a small vocabulary, or none fits)."""
    if vocab < 16384:
        return 0
    for c in range(max(256, -(-vocab // 512)), vocab // 32 + 1):
        if vocab % c == 0:
            return c
    return 0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens.

    Parameters
    ----------
    temperature : float
        0: greedy (argmax); > 0: sample from softmax(logits / temperature).
    top_k : int
        Keep the k most likely tokens (0: all).
    top_p : float
        Keep the smallest prefix of the sorted distribution whose mass reaches top_p (1: all).
    seed : int, optional
        Reproducible draws (same tokens on replay and eager); None: the device generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (_is_real(self.temperature) and 0.0 <= self.temperature < 1e4):
            raise ValueError(f"temperature = {self.temperature!r}, expected a float in [0, 1e4)")
        as_index("top_k", self.top_k, 0, (1 << 62))  # an int64 slot on the device
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p = {self.top_p!r}, expected a float in (0, 1]")
        if self.seed is not None:
            as_index("seed", self.seed, 0, (1 << 63) - 1)


def _is_real(value: object) -> bool:
    """A real number, not a bool (True is not a temperature)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def hash_uniform(seed: torch.Tensor, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from a hash of int64 (seed, position, token) (broadcast).

    Wrapping int64 arithmetic and masked shifts only: the same numbers on CPU and CUDA,
    inside or outside a CUDA graph.
    """
    x = seed * _M1 + position * _M2 + token * _M3
    for shift, mult in ((31, _M1), (29, _M2), (32, _M3)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    u = ((x >> 11) & _MASK53).double() * (1.0 / (1 << 53))
    return u.clamp(1e-12, 1 - 1e-12).float()


class SamplingTable:
    """Per-slot sampling parameters on the device, and the sampler that reads them.

    Parameters
    ----------
    max_num_reqs : int
    device : torch.device or str
    """

    def __init__(self, max_num_reqs: int, device: torch.device | str) -> None:
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.seeded = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)

    def set(self, slot: int, params: SamplingParams) -> None:
        """Write a request's parameters into its slot (at admission; fills, no host read)."""
        s = slice(slot, slot + 1)
        self.temperature[s].fill_(float(params.temperature))
        self.top_k[s].fill_(int(params.top_k))
        self.top_p[s].fill_(float(params.top_p))
        self.seed[s].fill_(0 if params.seed is None else int(params.seed))
        self.seeded[s].fill_(params.seed is not None)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their log-probabilities (capturable; fixed shapes).

        Parameters
        ----------
        logits : [n, vocab]
        slots : int64 [n]
            State slot of each row (padded rows: any slot; their tokens are unused).
        positions : int64 [n]
            Position the sampled token will take (the seeded hash's counter).

        Returns
        -------
        tokens : int64 [n]
        logprobs : float32 [n]
            log p(token) under the model's distribution (before temperature).
        """
        x, greedy, vals, idx, keep = self._sorted_kept(logits, slots)
        u = torch.where(self.seeded[slots][:, None],
                        hash_uniform(self.seed[slots][:, None], positions[:, None], idx),
                        torch.rand_like(vals))
        noisy = vals.masked_fill(~keep, float("-inf")) - torch.log(-torch.log(u))
        drawn = idx.gather(1, noisy.argmax(-1, keepdim=True)).squeeze(1)
        tokens = torch.where(greedy, greedy_tokens(x), drawn)
        logprobs = torch.log_softmax(x, -1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    def _sorted_kept(self, logits: torch.Tensor, slots: torch.Tensor,
                     ) -> tuple[torch.Tensor, ...]:
        """(float32 logits, greedy rows, temperature-scaled logits sorted descending, their
        token ids, the sorted entries top_k and top_p keep) of each row's slot."""
        x = logits.float()
        t = self.temperature[slots]
        greedy = t <= 0
        vals, idx = (x / torch.where(greedy, torch.ones_like(t), t)[:, None]).sort(
            -1, descending=True)
        rank = torch.arange(x.shape[-1], device=x.device)
        k = self.top_k[slots]
        keep = (k[:, None] <= 0) | (rank[None] < k[:, None])
        probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)
        keep &= (probs.cumsum(-1) - probs) < self.top_p[slots][:, None]
        return x, greedy, vals, idx, keep

    def probs(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution: softmax(logits / temperature) restricted to
        top_k and top_p, one-hot at the argmax for greedy rows (capturable).

        Parameters
        ----------
        logits : [n, vocab]
        slots : int64 [n]

        Returns
        -------
        torch.Tensor
            float32 [n, vocab], rows summing to 1.
        """
        x, greedy, vals, idx, keep = self._sorted_kept(logits, slots)
        sorted_p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)
        p = torch.zeros_like(x).scatter_(1, idx, sorted_p)
        one_hot = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        return torch.where(greedy[:, None], one_hot, p)

    def uniform(self, slots: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
                salt: int) -> torch.Tensor:
        """float32 uniforms [n, c]: the seeded hash of (seed, position, column + salt) for
        seeded rows, the device generator's otherwise (columns: int64 [n, c] or [c])."""
        cols = columns if columns.dim() == 2 else columns[None].expand(slots.shape[0], -1)
        hashed = hash_uniform(self.seed[slots][:, None], positions[:, None], cols + salt)
        return torch.where(self.seeded[slots][:, None], hashed, torch.rand_like(hashed))

    def draw(self, probs: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             salt: int) -> torch.Tensor:
        """int64 [n] tokens drawn from `probs` [n, vocab] (Gumbel-max; zero mass never
        drawn), with this table's noise for each row's slot and position."""
        u = self.uniform(slots, positions, torch.arange(probs.shape[-1], device=probs.device),
                         salt)
        return (probs.log() - torch.log(-torch.log(u))).argmax(-1)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     drafts: torch.Tensor, accept_u: torch.Tensor,
                     residual_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one draft per row (Leviathan et al.; Chen et al.): the draft
    d ~ q is kept with probability min(1, p(d) / q(d)); else a token is drawn from the
    residual max(0, p - q) / sum, so the kept-or-drawn token follows p exactly.

    Parameters
    ----------
    target_probs, draft_probs : float32 [n, vocab]
        p and q at each row's draft position.
    drafts : int64 [n]
        The drafts (drawn from q).
    accept_u : float32 [n]
        Uniforms in (0, 1).
    residual_draw : torch.Tensor
        float32 [n, vocab] uniforms in (0, 1) for the residual's Gumbel-max draw.

    Returns
    -------
    accepted : bool [n]
    token : int64 [n]
        The draft where accepted, the residual's draw elsewhere.
    """
    d = drafts.clamp(min=0)[:, None]
    p_d = target_probs.gather(1, d).squeeze(1)
    q_d = draft_probs.gather(1, d).squeeze(1)
    accepted = (drafts >= 0) & (accept_u * q_d <= p_d)
    residual = (target_probs - draft_probs).clamp(min=0)
    # p == q leaves no residual (and a rejection then has probability 0): fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs)
    drawn = (residual.log() - torch.log(-torch.log(residual_draw))).argmax(-1)
    return accepted, torch.where(accepted, drafts, drawn)
