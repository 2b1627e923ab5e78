"""Counter-based sampling noise: the noise a request's token at output position j sees depends only on
(request seed, j, token id), never on the batch, the drafter, the block size or how many cycles came before.

Sampling by an exponential race (the Gumbel-max trick in another form): with E(y) ~ Exp(1) independent per token,
argmax_y p(y) / E(y) is distributed exactly as p. If the target commits, at every output position, the winner of
that race under the position's noise, its output is a deterministic function of (seed, p): exactly what plain
decoding with the same noise commits, whatever drafted the tokens. A drafter that runs the same race on its own
distribution q (argmax_y q(y) / E(y)) proposes the target's winner with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)) (drafter-invariant speculative decoding, Daliri, Musco and Suresh), instead of
p(argmax q) for an argmax draft.

The noise is a hash, not a random stream: `lowbias32` (a 32-bit integer mixer) of a slot key (mixed from the
seed's two halves and the output position) XORed with the token's own code (its id mixed with a salt), turned into
a uniform with 24 bits (float32 keeps 23 of them above 1/2, so the race is exact but for events of probability
about 2^-23 per token) and then into Exp(1) by -log u.

What this module does not know about: models, temperature or top-k/top-p (applied to p and q by the caller).
"""

from __future__ import annotations

import functools
import secrets

import numpy as np
import torch

from flashdraft.engine.argmax import argmax

_MASK16, _MASK17, _MASK24 = 0xFFFF, 0x1FFFF, 0xFFFFFF
SMALLEST_EXPONENTIAL = 2.0 ** -25  # -log(1 - 2^-25), the noise of the top draw (`exponential`)
TOKEN_SALT = 0x9E3779B9  # the golden ratio's 32 bits: token ids are mixed with it into codes (`token_codes`)
SEED_HIGH_SALT = 0x5BD1E995  # what the position is mixed with before it meets the seed's high half (`slot_keys`)
PYTHON_KEYS = 16  # slot keys up to this many (rows x positions) are hashed in Python integers (`slot_keys`)
# Bumped whenever the noise of a (seed, output position, token) changes, or the rule that turns logits into the
# distribution it races on, and with either every seeded text: 1 the first scheme, 2 the top draw's noise fixed
# (`exponential`), 3 token codes (`token_codes`), 4 both halves of the seed mixed with every position (`slot_keys`),
# and top-p keeping the tokens tied at its cut together (`verify.target_probs`). Served responses carry it as
# `system_fingerprint`.
NOISE_VERSION = 4


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors, in place (multiplies wrap modulo 2^32; shifts are made logical by masking): the
    noise of a batch is [rows, width, vocab] integers, and a new tensor per step of the mixer took twice the time
    at 64 rows of vocab 8192 (measured, one CPU thread)."""
    x.bitwise_xor_((x >> 16).bitwise_and_(_MASK16))
    x.mul_(0x7FEB352D)
    x.bitwise_xor_((x >> 15).bitwise_and_(_MASK17))
    x.mul_(-0x7B935975)  # 0x846CA68B as a signed 32-bit number
    return x.bitwise_xor_((x >> 16).bitwise_and_(_MASK16))


def random_seed() -> int:
    """A seed for a request that did not ask for one (its text is then random, but still batch-invariant)."""
    return secrets.randbits(62)


def _mix32_numpy(x: np.ndarray) -> np.ndarray:
    """`mix32_` on uint32 arrays, in place (shifts are logical, products wrap): on the CPU 1.2-1.7x faster than the
    torch form at 16-64 rows of vocab 8192 (one scratch array where torch makes one per shift)."""
    shifted = np.empty_like(x)
    x ^= np.right_shift(x, np.uint32(16), out=shifted)
    x *= np.uint32(0x7FEB352D)
    x ^= np.right_shift(x, np.uint32(15), out=shifted)
    x *= np.uint32(0x846CA68B)
    x ^= np.right_shift(x, np.uint32(16), out=shifted)
    return x


def slot_keys(seeds: torch.Tensor, first_index: torch.Tensor, width: int) -> torch.Tensor:
    """The hash key [b, width] (int32, on the CPU) of row r's output position first_index[r] + i, that each token's
    code is then mixed into: lowbias32 of the two halves of the seed, each mixed with the position on its own. Two
    seeds differing in one half never share a key at a position; differing in both, they share one by chance, at each
    position apart. (Before `NOISE_VERSION` 4 the seed was first folded into a 32-bit row key: two seeds with the same
    row key shared the noise of every position, one pair in ~2^33 / N^2 of N unseeded requests, ~1 per 93,000.)
    A few integers per row, so hashed on the host whatever the device: up to PYTHON_KEYS of them in plain Python
    integers (numpy's ~20 calls on arrays of a few elements took ~150 us, over half of a one-row, one-position noise
    call on CPU), more in numpy (as torch operations they were ~40 calls, ~0.2 ms)."""
    if seeds.numel() * width <= PYTHON_KEYS:
        return _slot_keys_python(seeds, first_index, width)
    low32 = np.uint64(0xFFFFFFFF)
    seeds64 = seeds.cpu().numpy().astype(np.uint64)
    seed_lo, seed_hi = (seeds64 & low32).astype(np.uint32), ((seeds64 >> np.uint64(32)) & low32).astype(np.uint32)
    positions = ((first_index.cpu().numpy().astype(np.uint64)[:, None] + np.arange(width, dtype=np.uint64)[None])
                 & low32).astype(np.uint32)
    position_lo = _mix32_numpy(positions.copy())
    position_hi = _mix32_numpy(positions ^ np.uint32(SEED_HIGH_SALT))
    keys = _mix32_numpy(_mix32_numpy(seed_lo[:, None] ^ position_lo) ^ _mix32_numpy(seed_hi[:, None] ^ position_hi))
    return torch.from_numpy(np.ascontiguousarray(keys).view(np.int32))


def _mix32_int(x: int) -> int:
    """lowbias32 on a Python integer in [0, 2^32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _slot_keys_python(seeds: torch.Tensor, first_index: torch.Tensor, width: int) -> torch.Tensor:
    """`slot_keys` in plain Python integers (the same bits: Python's >> on a negative seed, then the mask, keeps
    the bits of its two's complement that numpy's uint64 view shifts down)."""
    keys = []
    for seed, start in zip(seeds.tolist(), first_index.tolist()):
        low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        for position in range(start, start + width):
            position &= 0xFFFFFFFF
            keys.append(_mix32_int(_mix32_int(low ^ _mix32_int(position))
                                   ^ _mix32_int(high ^ _mix32_int(position ^ SEED_HIGH_SALT))))
    return torch.from_numpy(np.array(keys, dtype=np.uint32).view(np.int32).reshape(len(seeds), width))


def exponential_noise(seeds: torch.Tensor, first_index: torch.Tensor, width: int, vocab: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """E [b, width, vocab] float32, i.i.d. Exp(1): row r, slot i, token y gets the noise of (seeds[r], output
    position first_index[r] + i, y). seeds and first_index are int64 [b]; the noise is made on `device` (None:
    theirs)."""
    device = seeds.device if device is None else torch.device(device)
    slot_key = slot_keys(seeds, first_index, width)  # [b, w], on the host
    # on the CPU the same bits through numpy's in-place uint32 arithmetic: 1.3-1.5x faster
    draws = _draws_numpy(slot_key, vocab) if device.type == "cpu" else _draws_torch(slot_key, vocab, device)
    return exponential(draws)


@functools.lru_cache(maxsize=8)
def token_codes(vocab: int) -> np.ndarray:
    """Each token id's code [V] (uint32, read-only): lowbias32(id ^ TOKEN_SALT), what a slot's key is XORed with
    before the last mix. With the raw ids there, two slots whose keys differ by some d < V had noise that was a
    permutation of each other's (token t at one = token t ^ d at the other): one pair of output positions in
    2^32 / V pairs (one in a 1,000-token answer at V = 8192, ~17 at 152k; ~2 between two such answers), whose
    races were then not independent. The codes are pseudo-random, so two slots share a value only by chance."""
    codes = _mix32_numpy(np.arange(vocab, dtype=np.uint32) ^ np.uint32(TOKEN_SALT))
    codes.setflags(write=False)
    return codes


@functools.lru_cache(maxsize=8)
def _token_codes_on(vocab: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(token_codes(vocab).view(np.int32).copy()).to(device)


def _draws_numpy(slot_key: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 24-bit draws [b, w, V] (as float32 integers) of every token at the slots `slot_key` [b, w], in numpy."""
    bits = _mix32_numpy(slot_key.numpy().view(np.uint32)[:, :, None] ^ token_codes(vocab))
    bits >>= np.uint32(8)
    return torch.from_numpy(bits.view(np.int32)).float()


def _draws_torch(slot_key: torch.Tensor, vocab: int, device: torch.device | str) -> torch.Tensor:
    """`_draws_numpy` in torch operations on `device`."""
    codes = _token_codes_on(vocab, torch.device(device))
    bits = mix32_(slot_key.to(codes.device)[:, :, None] ^ codes)
    return bits.bitwise_right_shift_(8).bitwise_and_(_MASK24).float()


def exponential(draws: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise from 24-bit draws, in place: -log of the uniform at the draw's cell centre. The top draw's
    centre, 1 - 2^-25, rounds to 1 in float32, whose -log is -0.0: a race divides by it (p / -0 = -inf, and 0 / -0 =
    NaN, which argmax takes as the maximum), so a token outside top-k / top-p or whose probability underflowed won
    at 1 in 2^24 / V positions. It gets its centre's value, 2^-25, instead (every other draw's noise is >= 1.2e-7)."""
    return draws.add_(0.5).mul_(1.0 / (1 << 24)).log_().neg_().clamp_min_(SMALLEST_EXPONENTIAL)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The token winning each position's exponential race: argmax p / E (distributed as p)."""
    return argmax(probs / noise)


def race_offsets(noise: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """What rows' logits z add for their argmax to be the race winner: with p = softmax(z / T), argmax p / E =
    argmax z / T - log E = argmax z - T log E. noise [g, w, V], temperatures [g] (> 0; greedy rows, whose noise is
    1, get 0 whatever their temperature) -> offsets [g, w, V]."""
    return noise.log().mul_(-temperatures.to(noise.dtype)[:, None, None])
