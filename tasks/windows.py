"""Token windows for the training stages, from the *train* split of a pack output only.

SFT and RL read the train split and nothing else: :class:`TrainShards` verifies the train
split's shards against the pack manifest (:func:`tasks.pack.verify_shards` with ``("train",)``)
and never opens a held-out shard; those belong to evaluate and verify.

Validation split, held out by position inside the training chromosomes. ``count`` windows of
``length`` tokens sit at the ends of training shards: among the ``S`` train shards that hold at
least ``length`` tokens (manifest order), window ``k`` (``k = 0 .. count - 1``) lies in shard
``floor(k S / count)``; a shard holding ``m`` validation windows gives them its last
``m x length`` tokens, in order, and its training windows tile ``[0, tokens - m x length)``.
So validation never shares a token with a training window, and which tokens are held out
depends on the shards, ``count`` and ``length`` only. The tail of a shard is one strand of one
stretch of a training chromosome: its other strand or its neighbouring bases may be trained on,
so validation measures fit to the training genomes, not generalisation (the held-out
chromosomes measure that, in evaluate).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class WindowError(ValueError):
    """The train split cannot supply the windows asked for; the message names the pack and the lengths."""


class TrainShards:
    """The verified train shards of a pack output, decoded one shard at a time.

    Args:
        pack_dir: a :func:`tasks.pack.pack` output directory.

    Raises:
        tasks.atomic.OutputIntegrityError: a train shard is missing, outside ``pack_dir`` or changed.
    """

    def __init__(self, pack_dir: str | os.PathLike):
        from tasks.pack import verify_shards

        self.pack_dir = Path(pack_dir)
        self.manifest = verify_shards(self.pack_dir, ("train",))
        self.shards: list[dict] = self.manifest["splits"]["train"]["shards"]
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def stream(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``i``'s token stream (uint8) and loss mask (bool); the last shard read stays decoded."""
        from tasks.pack import shard_token_stream

        if i not in self._cache:
            self._cache.clear()  # windows are drawn across shards at random: keep one decoded shard
            self._cache[i] = shard_token_stream(self.pack_dir / self.shards[i]["path"])
        return self._cache[i]

    def window(self, shard: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``[offset, offset + length)`` of shard ``shard`` as a next-token example.

        Returns:
            (input ids ``[length]`` int64, labels ``[length]`` int64 (``labels[t] = ids[t + 1]``,
            last = 0), target mask ``[length]`` bool (``loss_mask[t + 1]``, last False)).
        """
        tokens, mask = self.stream(shard)
        ids = tokens[offset: offset + length].astype(np.int64)
        labels = np.zeros_like(ids)
        labels[:-1] = ids[1:]
        target = np.zeros(length, bool)
        target[:-1] = mask[offset + 1: offset + length]
        return ids, labels, target


def validation_windows(shards: list[dict], count: int, length: int) -> list[tuple[int, int]]:
    """(shard index, token offset) of the ``count`` validation windows of ``length`` tokens (module docstring).

    Raises:
        WindowError: no shard holds ``length`` tokens, or a shard cannot hold its share.
    """
    if count == 0:
        return []
    candidates = [i for i, s in enumerate(shards) if s["tokens"] >= length]
    if not candidates:
        longest = max((s["tokens"] for s in shards), default=0)
        raise WindowError(f"no train shard holds a validation window of {length} tokens (longest {longest}); "
                          "lower eval_seq_len")
    share: dict[int, int] = {}
    for k in range(count):
        shard = candidates[k * len(candidates) // count]
        share[shard] = share.get(shard, 0) + 1
    windows = []
    for shard, m in share.items():
        tokens = shards[shard]["tokens"]
        if m * length > tokens:
            raise WindowError(f"train shard {shards[shard]['path']} ({tokens} tokens) cannot hold {m} validation "
                              f"windows of {length} tokens; lower eval_windows or eval_seq_len")
        windows += [(shard, tokens - (m - j) * length) for j in range(m)]
    return windows


class WindowSampler:
    """Deterministic, resumable training windows of ``seq_len`` tokens, and the validation windows.

    Training windows are ``[o, o + seq_len)`` for ``o = 0, seq_len, 2 seq_len, ...`` inside each
    train shard, stopping before the shard's validation tail (a remainder shorter than
    ``seq_len`` is not used). Global window ``i`` of the stream is ``perm_e[i mod n]`` with
    ``e = i div n`` and ``perm_e`` the permutation of the ``n`` windows drawn by
    ``numpy.random.default_rng((seed, e))``: the order depends on ``seed`` only, and any position
    can be read without replaying the ones before it.

    Args:
        pack_dir: a :func:`tasks.pack.pack` output directory (its train split is read).
        seq_len: tokens per training window.
        seed: order seed.
        validation_count, validation_len: validation windows held out at the shard ends
            (:func:`validation_windows`; 0 windows: none).

    Raises:
        WindowError: no training window of ``seq_len`` tokens remains, or the validation split
            does not fit.
    """

    def __init__(self, pack_dir: str | os.PathLike, seq_len: int, seed: int, validation_count: int = 0,
                 validation_len: int = 0):
        self.data = TrainShards(pack_dir)
        shards = self.data.shards
        self.seq_len, self.seed, self.validation_len = seq_len, seed, validation_len
        self.validation = validation_windows(shards, validation_count, validation_len)
        ends = [s["tokens"] for s in shards]
        for shard, offset in self.validation:
            ends[shard] = min(ends[shard], offset)
        self.windows = [(i, o) for i, end in enumerate(ends) for o in range(0, end - seq_len + 1, seq_len)]
        if not self.windows:
            longest = max(ends, default=0)
            raise WindowError(f"{self.data.pack_dir}: no train shard holds seq_len={seq_len} tokens outside the "
                              f"validation split (longest {longest}); lower seq_len")
        self.fingerprint = {"shards": [s["sha256"] for s in shards], "seq_len": seq_len, "seed": seed,
                            "validation": [validation_count, validation_len]}
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.windows)

    def index(self, position: int) -> tuple[int, int]:
        """(shard index, token offset) of the training window at stream position ``position``."""
        epoch, i = divmod(position, len(self.windows))
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng((self.seed, epoch)).permutation(len(self.windows)))
        return self.windows[int(self._perm[1][i])]

    def window(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Training window at stream position ``position`` (:meth:`TrainShards.window`'s arrays)."""
        return self.data.window(*self.index(position), self.seq_len)

    def validation_window(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validation window ``k`` (:meth:`TrainShards.window`'s arrays, ``validation_len`` tokens)."""
        return self.data.window(*self.validation[k], self.validation_len)
