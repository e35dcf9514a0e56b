"""The tensor digest: a checksum of a tensor's bytes that a GPU computes with plain torch ops.

Definition (``DIGEST_NAME``; docs/trace-format.md says the same in words):

* The bytes of the tensor in C order, ``N`` of them, zero-padded to a multiple of 4, read as
  signed 32-bit little-endian words ``u_i``.
* Blocks of ``BLOCK`` = 1024 words (4 KiB); the last block is zero-padded.
* Two weight tables ``W_a[r]``, ``W_b[r]`` (r < 1024) of integers in [1, 2**20]:
  ``splitmix64(r + 1) % 2**20 + 1`` and ``splitmix64(r + 1025) % 2**20 + 1``, where
  ``splitmix64(x)`` is Vigna's finaliser of ``x * 0x9E3779B97F4A7C15`` modulo 2**64.
* Block sums ``s_a[q] = sum_r u[1024 q + r] * W_a[r]`` (and ``s_b`` with ``W_b``): exact in
  int64 (``|s| <= 2**31 * 2**20 * 2**10 = 2**61``) whatever the order of the additions, so a GPU
  reduction, numpy and a compiled loop agree bit for bit.
* With the primes ``P_A = 2**32 - 5`` and ``P_B = 2**31 - 1``, and ``x mod P`` in [0, P):
  ``D_a = (N + sum_q (s_a[q] mod P_A) * (q + 1)) mod P_A`` and
  ``D_b = sum_q (s_b[q] mod P_B) * ((q + 1)**2 mod P_B) mod P_B``.
* The digest is ``D_a`` then ``D_b`` as 8 lowercase hex digits each (16 in all).

What it guarantees: a change of one word always changes the digest (``du * W_a`` is a multiple
of the prime ``P_A`` only when ``|du| = P_A``, and that ``du`` is no multiple of ``P_B``); a
change confined to two blocks with equal block sums in one lane still changes the other; other
changes collide with a chance near ``2**-63`` for the pseudo-random weights. It is a checksum
against damage and a test of bit-equality between runs, not a cryptographic hash. Traces
written before it carry xxh3-64 digests (``LEGACY_DIGEST``): the trace's meta
``tensor_digest`` says which.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

DIGEST_NAME = "layerdiff-wsum32"
LEGACY_DIGEST = "xxh3-64"  # traces without meta["tensor_digest"]
BLOCK = 1024  # words per block
WORD = 4
BLOCK_BYTES = WORD * BLOCK
PRIME_A = 2**32 - 5
PRIME_B = 2**31 - 1
WEIGHT_BITS = 20


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.cache
def weights() -> np.ndarray:
    """The (BLOCK, 2) table ``[W_a, W_b]`` as int64 (read-only)."""
    r = np.arange(1, BLOCK + 1, dtype=np.uint64)
    mask = np.uint64(2**WEIGHT_BITS - 1)
    with np.errstate(over="ignore"):  # splitmix64 multiplies modulo 2**64 by design
        table = np.stack([(_splitmix64(r) & mask) + np.uint64(1),
                          (_splitmix64(r + np.uint64(BLOCK)) & mask) + np.uint64(1)], axis=1)
    table = table.astype(np.int64)
    table.flags.writeable = False
    return table


@functools.cache
def lanes() -> tuple[np.ndarray, np.ndarray]:
    """``weights()``'s two columns, each contiguous (what the compiled passes take)."""
    table = weights()
    return np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])


def block_sums(data: np.ndarray) -> np.ndarray:
    """The (blocks, 2) int64 block sums of a uint8 array whose length is a multiple of 4
    (the last block may be short): numpy's path, exact in int64."""
    words = data.view("<i4")
    out = np.empty((-(-words.size // BLOCK), 2), dtype=np.int64)
    table = weights()
    step = 1 << 10  # blocks at a time: bounds the int64 temporaries at 8 MiB
    for start in range(0, len(out), step):
        chunk = words[start * BLOCK:(start + step) * BLOCK].astype(np.int64)
        whole = chunk.size // BLOCK
        stop = start + whole
        out[start:stop] = chunk[:whole * BLOCK].reshape(whole, BLOCK) @ table
        if chunk.size % BLOCK:
            out[stop] = chunk[whole * BLOCK:] @ table[:chunk.size % BLOCK]
    return out


def fold(sums: np.ndarray, first_block: int, state: tuple[int, int]) -> tuple[int, int]:
    """Add block sums (of blocks ``first_block``, ``first_block + 1``, ...) to the lanes."""
    if not len(sums):
        return state
    q = np.arange(first_block + 1, first_block + 1 + len(sums), dtype=np.int64)
    a = int((np.mod(sums[:, 0], PRIME_A) * q % PRIME_A).sum() % PRIME_A)
    qb = q % PRIME_B
    b = int((np.mod(sums[:, 1], PRIME_B) * (qb * qb % PRIME_B) % PRIME_B).sum() % PRIME_B)
    return (state[0] + a) % PRIME_A, (state[1] + b) % PRIME_B


def finish(state: tuple[int, int], nbytes: int) -> str:
    return f"{(state[0] + nbytes) % PRIME_A:08x}{state[1]:08x}"


def digest_bytes(data: np.ndarray, kernel: Any = None) -> str:
    """The digest of a uint8 array (any length); ``kernel``: the compiled module
    (trace/stats_kernel.py), used for arrays large enough to pay for the call."""
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if kernel is not None and data.size >= KERNEL_MIN_BYTES:
        return finish(kernel.digest_lanes(data, weights()), data.size)
    return finish(fold(block_sums(padded(data)), 0, (0, 0)), data.size)


def padded(data: np.ndarray) -> np.ndarray:
    """``data`` zero-padded to a whole number of words."""
    extra = -data.size % WORD
    return data if not extra else np.concatenate([data, np.zeros(extra, np.uint8)])


class Digester:
    """The digest of bytes fed in order, in chunks of any size (verify's streaming reads)."""

    def __init__(self, kernel: Any = None) -> None:
        self._kernel = kernel  # the compiled module, or None for numpy
        self._carry = np.empty(0, dtype=np.uint8)
        self._blocks = 0
        self._nbytes = 0
        self._state = (0, 0)

    def update(self, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._nbytes += data.size
        if self._carry.size:
            data = np.concatenate([self._carry, data])
        whole = data.size - data.size % BLOCK_BYTES
        if whole:
            self._add(data[:whole])
        self._carry = data[whole:].copy()

    def _add(self, data: np.ndarray) -> None:
        if self._kernel is not None:
            self._state = self._kernel.fold_lanes(data, weights(), self._blocks, *self._state)
        else:
            self._state = fold(block_sums(data), self._blocks, self._state)
        self._blocks += data.size // BLOCK_BYTES

    def hexdigest(self) -> str:
        state = self._state
        if self._carry.size:
            state = fold(block_sums(padded(self._carry)), self._blocks, state)
        return finish(state, self._nbytes)


class _Legacy:
    """xxh3-64 with Digester's interface, for traces written before DIGEST_NAME."""

    def __init__(self) -> None:
        import xxhash
        self._hash = xxhash.xxh3_64()

    def update(self, data: np.ndarray) -> None:
        self._hash.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def hasher(algorithm: str, kernel: Any = None) -> Digester | _Legacy:
    """A streaming hasher of the tensor digest a trace names (its meta ``tensor_digest``)."""
    return _Legacy() if algorithm == LEGACY_DIGEST else Digester(kernel)


# Below this many bytes numpy's path costs no more than a call into the compiled one.
KERNEL_MIN_BYTES = 1 << 16
