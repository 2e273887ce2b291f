"""A small, learnable stand-in for MNIST, written in MNIST's own file format.

The MNIST example notebook loads its data with
``torchvision.datasets.MNIST(root, download=False)``. Where the real data set
cannot be downloaded (no network, as in CI), this module writes a synthetic one
to the same place, in the same IDX format, so the notebook runs unchanged.

The digits are drawn from a hand-made 5x7 bitmap font, traced as strokes and
rendered at 28x28 with random placement, size, slant, rotation, stroke
thickness, wobble and pixel noise. That keeps the task a real one: a model
has to learn the digit shapes, and a small CNN gets well over 90% test
accuracy within an epoch or two, so the demo's accuracy line means something.

Usage::

    python examples/mnist_data.py DIR [--train N] [--test M] [--seed S] [--force]
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

SIZE = 28
N_TRAIN = 6000
N_TEST = 1000
MARKER = "SYNTHETIC"

# One 5x7 glyph per digit; '#' is ink. Shapes follow how digits are written by
# hand (open 4, flat-topped 5, tailed 6 and 9) so the classes stay distinct.
FONT: dict[int, tuple[str, ...]] = {
    0: (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    1: ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    2: (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    3: (".###.", "#...#", "....#", "..##.", "....#", "#...#", ".###."),
    4: ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    5: ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    6: ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    7: ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    8: (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    9: (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
}
ROWS, COLS = 7, 5

# File names torchvision's MNIST reads (uncompressed: its _check_exists and
# _load_data look for exactly these, without the .gz of the download).
FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def glyph_segments(digit: int) -> np.ndarray:
    """Return the glyph as stroke segments, shape (K, 2, 2) of (row, col) cell ends.

    Strokes join ink cells to their right and lower neighbours, and to
    diagonal ones only where no orthogonal path exists, so slanted strokes
    stay continuous without blobs at corners. An ink cell with no neighbour
    gets a zero-length segment so it is never lost.
    """
    ink = {(r, c) for r, line in enumerate(FONT[digit]) for c, ch in enumerate(line) if ch == "#"}
    segs: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for r, c in sorted(ink):
        for dr, dc in ((0, 1), (1, 0)):
            if (r + dr, c + dc) in ink:
                segs.append(((r, c), (r + dr, c + dc)))
        for dc in (1, -1):
            corner_free = (r + 1, c) not in ink and (r, c + dc) not in ink
            if (r + 1, c + dc) in ink and corner_free:
                segs.append(((r, c), (r + 1, c + dc)))
    joined = {end for seg in segs for end in seg}
    segs += [(cell, cell) for cell in sorted(ink - joined)]
    return np.array(segs, dtype=np.int64)


def _segment_table() -> np.ndarray:
    """Return vertex indices (10, K, 2) for every digit's segments, padded.

    Segments are stored as indices into the 7x5 grid so each image can wobble
    the grid points once and have all strokes follow. Padding repeats the
    first segment, which leaves the rendered ink (a maximum) unchanged.
    """
    per_digit = [glyph_segments(d) for d in range(10)]
    k = max(len(s) for s in per_digit)
    table = np.zeros((10, k, 2), dtype=np.int64)
    for d, segs in enumerate(per_digit):
        idx = segs[..., 0] * COLS + segs[..., 1]
        table[d, : len(idx)] = idx
        table[d, len(idx) :] = idx[0]
    return table


def _random_params(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Draw every random choice for n images up front.

    Drawing everything before rendering makes the output depend only on the
    seed and n, not on how rendering is chunked.
    """
    return {
        "scale": rng.uniform(2.1, 3.2, n),
        "aspect": rng.uniform(0.75, 1.25, n),
        "shear": rng.uniform(-0.5, 0.5, n),
        "angle": rng.uniform(-0.3, 0.3, n),
        "shift": rng.uniform(-1.5, 1.5, (n, 2)),
        "wobble": rng.normal(0.0, 0.2, (n, ROWS * COLS, 2)),
        "radius": rng.uniform(0.6, 1.9, n),
        "ink": rng.uniform(0.7, 1.0, n),
        "noise": rng.normal(0.0, 0.06, (n, SIZE, SIZE)),
    }


def _grid_points(p: dict[str, np.ndarray], sl: slice) -> np.ndarray:
    """Map the (wobbled) 7x5 glyph grid into pixel space, shape (n, 35, 2) as (y, x)."""
    rows, cols = np.meshgrid(np.arange(ROWS), np.arange(COLS), indexing="ij")
    uv = np.stack([cols - (COLS - 1) / 2, rows - (ROWS - 1) / 2], -1).reshape(-1, 2)
    uv = uv[None] + p["wobble"][sl]  # (n, 35, 2) as (u=x, v=y)
    s, a = p["scale"][sl, None], p["aspect"][sl, None]
    u = uv[..., 0] * s * a + uv[..., 1] * s * p["shear"][sl, None]
    v = uv[..., 1] * s
    cos, sin = np.cos(p["angle"][sl, None]), np.sin(p["angle"][sl, None])
    x = cos * u - sin * v + (SIZE - 1) / 2 + p["shift"][sl, 0, None]
    y = sin * u + cos * v + (SIZE - 1) / 2 + p["shift"][sl, 1, None]
    return np.stack([y, x], -1)


def _render(labels: np.ndarray, p: dict[str, np.ndarray], sl: slice) -> np.ndarray:
    """Render images sl of the set as float intensities, shape (n, 28, 28).

    Ink falls off linearly over one pixel beyond the stroke radius, which
    anti-aliases the edges the way scanned pen strokes look. Looping over
    segments keeps every array at (n, 784), which is what makes this fast.
    """
    table = _segment_table()
    pts = _grid_points(p, sl).astype(np.float32)  # (n, 35, 2)
    idx = table[labels[sl]]  # (n, K, 2)
    rows = np.arange(len(idx))[:, None]
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].reshape(2, 1, -1).astype(np.float32)  # (1, 784) each
    dist2 = np.full((len(idx), SIZE * SIZE), np.inf, dtype=np.float32)
    for k in range(idx.shape[1]):
        a, b = pts[rows, idx[:, k, 0, None]], pts[rows, idx[:, k, 1, None]]  # (n, 1, 2)
        ay, ax, dy, dx = a[..., 0], a[..., 1], b[..., 0] - a[..., 0], b[..., 1] - a[..., 1]
        t = np.clip(((yy - ay) * dy + (xx - ax) * dx) / np.maximum(dy * dy + dx * dx, 1e-6), 0.0, 1.0)
        np.minimum(dist2, (yy - ay - t * dy) ** 2 + (xx - ax - t * dx) ** 2, out=dist2)
    ink = np.clip(p["radius"][sl, None] + 0.5 - np.sqrt(dist2), 0.0, 1.0) * p["ink"][sl, None]
    return ink.reshape(-1, SIZE, SIZE) + p["noise"][sl]


def make_digits(n: int, seed: int = 0, chunk: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 (n, 28, 28), labels uint8 (n,)) for a seed.

    Labels are balanced (each digit n/10 times, shuffled) so every class is
    present even in small sets.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    params = _random_params(n, rng)
    images = np.empty((n, SIZE, SIZE), dtype=np.uint8)
    for start in range(0, n, chunk):
        sl = slice(start, min(start + chunk, n))
        images[sl] = np.clip(np.rint(_render(labels, params, sl) * 255), 0, 255)
    return images, labels.astype(np.uint8)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (magic 0x08 type code, big-endian sizes)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist(root: str | Path, n_train: int = N_TRAIN, n_test: int = N_TEST, seed: int = 0) -> Path:
    """Write the synthetic set under root/MNIST/raw/ and return that folder.

    Train and test come from different seeds derived from `seed`, so the test
    images are never copies of training ones. A marker file records that the
    set is synthetic, so callers can tell it from the real one later.
    """
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for train, n, sub_seed in ((True, n_train, 0), (False, n_test, 1)):
        images, labels = make_digits(n, seed=seed * 2 + sub_seed)
        write_idx(raw / FILES[train][0], images)
        write_idx(raw / FILES[train][1], labels)
    (raw / MARKER).write_text(
        f"Synthetic MNIST-format digits from examples/mnist_data.py "
        f"(train={n_train}, test={n_test}, seed={seed}); not the real MNIST.\n"
    )
    return raw


def mnist_present(root: str | Path) -> bool:
    """True if torchvision can load both MNIST splits from root without downloading."""
    from torchvision import datasets

    try:
        for train in (True, False):
            datasets.MNIST(str(root), train=train, download=False)
    except (RuntimeError, OSError, ValueError, TypeError):
        return False
    return True


def is_synthetic(root: str | Path) -> bool:
    """True if the MNIST folder under root was written by this module."""
    return (Path(root) / "MNIST" / "raw" / MARKER).is_file()


def ensure_mnist(root: str | Path, n_train: int = N_TRAIN, n_test: int = N_TEST, seed: int = 0) -> bool:
    """Make sure root holds an MNIST set; return True if a synthetic one was written.

    An MNIST folder that torchvision already loads (the real data, or a set
    written earlier) is left alone, so real data always wins. Nothing is ever
    downloaded.
    """
    if mnist_present(root):
        return False
    write_mnist(root, n_train=n_train, n_test=n_test, seed=seed)
    return True


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: write the synthetic set into DIR."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="root folder, as passed to torchvision.datasets.MNIST")
    parser.add_argument("--train", type=int, default=N_TRAIN, help="training images (default %(default)s)")
    parser.add_argument("--test", type=int, default=N_TEST, help="test images (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="write even if an MNIST set is present")
    args = parser.parse_args(argv)
    if args.force:
        raw = write_mnist(args.dir, args.train, args.test, args.seed)
    elif not ensure_mnist(args.dir, args.train, args.test, args.seed):
        print(f"An MNIST set is already present under {args.dir}; left unchanged (use --force to overwrite).")
        return 0
    else:
        raw = Path(args.dir) / "MNIST" / "raw"
    print(f"Wrote {args.train} training and {args.test} test images to {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
