"""train-mtp plots: the loss curve (and held-out top-1 agreement) as a PNG, through
matplotlib when installed, else drawn and PNG-encoded here."""
from __future__ import annotations

from pathlib import Path


def _smooth(values: list[float]) -> tuple[list[float], int]:
    window = max(1, len(values) // 50)
    out = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
           for i in range(len(values))]
    return out, window


def plot_losses(losses: list[float], path: Path, curve: list[dict] | None = None) -> None:
    """Loss curve (and the held-out slice's top-1 agreement, right axis) as a PNG: matplotlib
    when installed, else a plain plot drawn here (no labels; the numbers are in the JSON)."""
    try:
        import matplotlib
    except ImportError:
        _plain_png(losses, path, curve)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smooth, window = _smooth(losses)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.3, label="batch loss")
    ax.plot(smooth, label=f"moving mean ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("distillation loss (nats)")
    ax.set_title("MTP head self-distillation")
    lines, labels = ax.get_legend_handles_labels()
    points = [c for c in (curve or []) if "top1" in c]
    if points:
        ax2 = ax.twinx()
        ax2.plot([c["step"] for c in points], [c["top1"] for c in points], "g.-",
                 label="held-out slice top-1 (draft 1)")
        ax2.plot([c["step"] for c in points], [c["train_top1"] for c in points], "c.:",
                 label="train top-1 (draft 1)")
        ax2.set_ylabel("top-1 agreement with the target")
        ax2.set_ylim(0, 1)
        l2, lb2 = ax2.get_legend_handles_labels()
        lines, labels = lines + l2, labels + lb2
    ax.legend(lines, labels, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plain_png(losses: list[float], path: Path, curve: list[dict] | None,
               width: int = 700, height: int = 400) -> None:
    """Axes box, batch loss (light blue), its moving mean (blue), held-out top-1 (green,
    0..1 on the full height) drawn into an RGB array, written as PNG with zlib."""
    img = [[[255, 255, 255] for _ in range(width)] for _ in range(height)]
    left, right, top, bottom = 50, width - 20, 20, height - 40

    def put(x: float, y: float, color: tuple[int, int, int]) -> None:
        xi, yi = int(round(x)), int(round(y))
        if 0 <= xi < width and 0 <= yi < height:
            img[yi][xi] = list(color)

    def line(p: tuple[float, float], q: tuple[float, float], color) -> None:
        n = int(max(abs(q[0] - p[0]), abs(q[1] - p[1]), 1))
        for i in range(n + 1):
            put(p[0] + (q[0] - p[0]) * i / n, p[1] + (q[1] - p[1]) * i / n, color)

    for a, b in (((left, top), (right, top)), ((right, top), (right, bottom)),
                 ((right, bottom), (left, bottom)), ((left, bottom), (left, top))):
        line(a, b, (0, 0, 0))
    if losses:
        lo, hi = min(losses), max(losses)
        span = (hi - lo) or 1.0
        n = max([1, len(losses) - 1] + [c["step"] for c in (curve or [])])

        def xy(i: float, v: float) -> tuple[float, float]:
            return (left + (right - left) * i / n, bottom - (bottom - top) * (v - lo) / span)

        smooth, _ = _smooth(losses)
        for series, color in ((losses, (170, 200, 240)), (smooth, (30, 80, 200))):
            for i in range(1, len(series)):
                line(xy(i - 1, series[i - 1]), xy(i, series[i]), color)
        pts = [((left + (right - left) * c["step"] / n), bottom - (bottom - top) * c["top1"])
               for c in (curve or []) if "top1" in c]
        for a, b in zip(pts, pts[1:]):
            line(a, b, (20, 150, 40))
    Path(path).write_bytes(_png_bytes(img, width, height))


def _png_bytes(img: list[list[list[int]]], width: int, height: int) -> bytes:
    """An RGB array [height][width][3] as PNG (8-bit truecolour, zlib, no filtering)."""
    import struct
    import zlib

    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(
            ">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                                0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
