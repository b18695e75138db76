"""The architecture figure at the top of every chapter: the encoder-decoder of the paper's Figure 1.

``architecture(highlight=["cross_attention"], notes={"cross_attention": "queries: target"})`` draws the
whole model with the named parts in colour and the rest in grey; each note puts a numbered badge on
its part and a line of text in the legend. Chapters call it from a cell whose input is hidden; the
pages run in ``book/``, so ``from figures import architecture`` finds this file.

The parts: ``input_embedding``, ``output_embedding``, ``positional_encoding``,
``encoder_self_attention``, ``decoder_self_attention``, ``cross_attention``, ``encoder_feed_forward``,
``decoder_feed_forward``, ``linear``, ``softmax``; one side's ``encoder_add_norm``, ``encoder_residual``,
``encoder_positional``, ``encoder_frame`` (the N× box) and the decoder's likewise; and the groups
``add_norm``, ``residual``, ``positional_encoding`` (both sides), ``embeddings``, ``attention``,
``feed_forward``, ``encoder`` and ``decoder`` (every part of one side, with its frame), ``generator``
(linear and softmax) and ``all``.
"""

import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch

# The paper's colours, roughly: what each kind of box looks like when it is highlighted.
COLOURS = {
    "embedding": "#f6c9c4",
    "attention": "#f9d9a8",
    "add_norm": "#f2eda2",
    "feed_forward": "#bfe3f2",
    "linear": "#d8d3ec",
    "softmax": "#cde8c2",
    "positional": "#ffffff",
}
GREY_FACE, GREY_EDGE, GREY_TEXT = "#f3f3f3", "#bdbdbd", "#9a9a9a"
HIGHLIGHT_EDGE = "#1f1f1f"

GROUPS = {
    "embeddings": {"input_embedding", "output_embedding"},
    "attention": {"encoder_self_attention", "decoder_self_attention", "cross_attention"},
    "feed_forward": {"encoder_feed_forward", "decoder_feed_forward"},
    "generator": {"linear", "softmax"},
    "encoder": {"input_embedding", "encoder_self_attention", "encoder_feed_forward", "encoder_add_norm",
                "encoder_residual", "encoder_frame", "encoder_positional"},
    "decoder": {"output_embedding", "decoder_self_attention", "cross_attention", "decoder_feed_forward",
                "decoder_add_norm", "decoder_residual", "decoder_frame", "decoder_positional"},
    "add_norm": {"encoder_add_norm", "decoder_add_norm"},
    "residual": {"encoder_residual", "decoder_residual"},
    "positional_encoding": {"encoder_positional", "decoder_positional"},
}
PARTS = {"input_embedding", "output_embedding", "encoder_self_attention", "decoder_self_attention",
         "cross_attention", "encoder_feed_forward", "decoder_feed_forward", "linear", "softmax"}
GROUPS["all"] = set().union(PARTS, *GROUPS.values())


def _expand(names: Iterable[str]) -> set[str]:
    found = set()
    for name in names:
        if name in GROUPS:
            found |= GROUPS[name]
        elif name in GROUPS["all"]:
            found.add(name)
        else:
            known = ", ".join(sorted(GROUPS["all"] | GROUPS.keys()))
            raise ValueError(f"unknown part {name!r}; the parts are: {known}")
    return found


@dataclass
class _Box:
    part: str
    label: str
    kind: str
    bottom: float
    height: float


class _Drawing:
    def __init__(self, ax: plt.Axes, lit: set[str], everything_lit: bool) -> None:
        self.ax, self.lit, self.everything_lit = ax, lit, everything_lit
        self.anchors: dict[str, tuple[float, float]] = {}

    def on(self, part: str) -> bool:
        return self.everything_lit or part in self.lit

    def line_colour(self, part: str) -> str:
        return "#333333" if self.on(part) else GREY_EDGE

    def box(self, part: str, label: str, kind: str, x: float, y: float, width: float, height: float,
            group_part: str | None = None) -> None:
        on = self.on(part) or (group_part is not None and self.on(group_part))
        highlighted = on and not self.everything_lit
        self.ax.add_patch(FancyBboxPatch(
            (x - width / 2, y), width, height, boxstyle="round,pad=0,rounding_size=0.12",
            facecolor=COLOURS[kind] if on else GREY_FACE,
            edgecolor=HIGHLIGHT_EDGE if highlighted else ("#555555" if on else GREY_EDGE),
            linewidth=2.4 if highlighted else 1.0, zorder=3))
        self.ax.text(x, y + height / 2, label, ha="center", va="center", fontsize=8.5, zorder=4,
                     color="#111111" if on else GREY_TEXT, fontweight="bold" if highlighted else "normal")
        self.anchors.setdefault(part, (x + width / 2, y + height))

    def arrow(self, start: tuple[float, float], end: tuple[float, float], part: str, head: bool = True) -> None:
        self.ax.annotate("", xy=end, xytext=start, zorder=2,
                         arrowprops=dict(arrowstyle="-|>" if head else "-", color=self.line_colour(part),
                                         lw=1.6 if self.on(part) and not self.everything_lit else 1.1,
                                         shrinkA=0, shrinkB=0, mutation_scale=9))

    def path(self, points: list[tuple[float, float]], part: str) -> None:
        for a, b in zip(points[:-2], points[1:-1], strict=True):
            self.arrow(a, b, part, head=False)
        self.arrow(points[-2], points[-1], part)


# Layout, in data units: the encoder's column is centred at ENC, the decoder's at DEC.
ENC, DEC, WIDTH = 3.3, 8.7, 3.0
LEGEND_CHARS = 40  # a legend line this long ends before the decoder's column
BOX, NORM, GAP = 0.95, 0.5, 0.42


def _stack(d: _Drawing, side: str, centre: float, bottom: float) -> float:
    """One side's N× stack of sublayers, each followed by Add & Norm; returns the frame's top."""
    sublayers = ([("encoder_self_attention", "Multi-Head\nAttention", "attention")] if side == "encoder" else
                 [("decoder_self_attention", "Masked\nMulti-Head\nAttention", "attention"),
                  ("cross_attention", "Multi-Head\nAttention", "attention")])
    sublayers.append((f"{side}_feed_forward", "Feed\nForward", "feed_forward"))
    outward = -1 if side == "encoder" else 1  # residual paths run on the outer side of each column
    frame_bottom, y = bottom, bottom + 0.35
    for i, (part, label, kind) in enumerate(sublayers):
        height = 1.25 if label.count("\n") == 2 else BOX
        into_x = centre + 0.55 if part == "cross_attention" else centre
        if i > 0:
            top_of_norm = y - GAP - (0.25 if part == "cross_attention" else 0)
            d.arrow((into_x, top_of_norm), (into_x, y), part)
        else:  # from the positional encoding's sum
            d.arrow((centre, 2.85), (centre, y), part)
        d.box(part, label, kind, centre, y, WIDTH, height)
        # the residual: from below the sublayer, around it, into the side of Add & Norm
        branch_y = y - 0.2 if i == 0 else y - GAP / 2 - (0.12 if part == "cross_attention" else 0)
        side_x = centre + outward * (WIDTH / 2 + 0.35)
        norm_y = y + height + GAP
        d.path([(into_x if part == "cross_attention" else centre, branch_y), (side_x, branch_y),
                (side_x, norm_y + NORM / 2), (centre + outward * WIDTH / 2, norm_y + NORM / 2)], f"{side}_residual")
        d.arrow((centre, y + height), (centre, norm_y), part)
        d.box(f"{side}_add_norm", "Add & Norm", "add_norm", centre, norm_y, WIDTH, NORM)
        if part == "cross_attention":
            d.anchors["cross_attention_keys"] = (centre, y)
        y = norm_y + NORM + GAP + (0.25 if i == 0 and side == "decoder" else 0)
    frame_top = y - GAP + 0.3
    on = d.on(f"{side}_frame") and not d.everything_lit
    d.ax.add_patch(FancyBboxPatch(
        (centre - WIDTH / 2 - 0.65, frame_bottom), WIDTH + 1.3, frame_top - frame_bottom,
        boxstyle="round,pad=0,rounding_size=0.25", facecolor="#fafafa" if not on else "#fffaf0",
        edgecolor=HIGHLIGHT_EDGE if on else "#9e9e9e", linewidth=2.0 if on else 1.0, zorder=1))
    d.anchors[f"{side}_frame"] = (centre + WIDTH / 2 + 0.65, frame_top)
    label_x = centre + outward * (WIDTH / 2 + 1.05)
    d.ax.text(label_x, (frame_bottom + frame_top) / 2, "N×" if side == "encoder" else "×N", ha="center",
              va="center", fontsize=11, color="#333333")
    return frame_top


def _positional(d: _Drawing, side: str, centre: float, y: float) -> None:
    part = f"{side}_positional"
    outward = -1 if side == "encoder" else 1
    on = d.on(part)
    colour = "#333333" if on else GREY_EDGE
    d.ax.add_patch(Circle((centre, y), 0.2, facecolor="white", edgecolor=colour, lw=1.2, zorder=3))
    d.ax.text(centre, y, "+", ha="center", va="center", fontsize=11, color=colour, zorder=4)
    icon_x = centre + outward * 1.15
    highlighted = on and not d.everything_lit
    d.ax.add_patch(Circle((icon_x, y), 0.32, facecolor="white", edgecolor=HIGHLIGHT_EDGE if highlighted else colour,
                          lw=2.2 if highlighted else 1.0, zorder=3))
    xs = [icon_x - 0.22 + 0.44 * i / 40 for i in range(41)]
    d.ax.plot(xs, [y + 0.13 * math.sin(2 * math.pi * (x - icon_x) / 0.44) for x in xs], color=colour, lw=1.0,
              zorder=4)
    d.arrow((icon_x - outward * 0.32, y), (centre + outward * 0.2, y), part)
    d.ax.text(icon_x + outward * 0.45, y, "Positional\nEncoding", ha="left" if outward > 0 else "right",
              va="center", fontsize=8, color="#111111" if on else GREY_TEXT,
              fontweight="bold" if highlighted else "normal")
    d.anchors[part] = (icon_x + 0.3, y + 0.3)


def architecture(highlight: Iterable[str] = (), notes: dict[str, str] | None = None,
                 title: str | None = None) -> Figure:
    """Draw the Transformer of the paper's Figure 1, with ``highlight`` (parts or groups) in colour.

    ``notes`` maps a part (or group) to a short text: a numbered badge marks the part and the text
    appears, with its number, in the legend at the top left.
    """
    lit = _expand(highlight)
    notes = dict(notes or {})
    _expand(notes)  # unknown names fail here, with the list of known ones
    fig, ax = plt.subplots(figsize=(6.4, 6.6))
    ax.axis("off")
    d = _Drawing(ax, lit, everything_lit=not lit)

    # the inputs, their embeddings and positions
    for side, centre, label, words in (("encoder", ENC, "Input\nEmbedding", "Inputs"),
                                       ("decoder", DEC, "Output\nEmbedding", "Outputs\n(shifted right)")):
        part = "input_embedding" if side == "encoder" else "output_embedding"
        ax.text(centre, 0.15, words, ha="center", va="center", fontsize=8.5)
        d.arrow((centre, 0.55), (centre, 0.95), part)
        d.box(part, label, "embedding", centre, 0.95, WIDTH - 0.6, 0.95)
        d.arrow((centre, 1.9), (centre, 2.45), part)
        _positional(d, side, centre, 2.65)

    encoder_top = _stack(d, "encoder", ENC, 3.4)
    decoder_top = _stack(d, "decoder", DEC, 3.4)

    # the encoder's output (the memory) becomes the keys and values of every cross-attention
    keys_x, keys_y = d.anchors["cross_attention_keys"]
    memory_part = "cross_attention"
    lane_y = keys_y - 0.28
    d.path([(ENC, encoder_top), (ENC, encoder_top + 0.45), (5.95, encoder_top + 0.45), (5.95, lane_y),
            (keys_x - 0.95, lane_y), (keys_x - 0.95, keys_y)], memory_part)
    d.arrow((keys_x - 0.35, lane_y), (keys_x - 0.35, keys_y), memory_part)
    d.arrow((keys_x - 0.95, lane_y), (keys_x - 0.35, lane_y), memory_part, head=False)

    # the generator: a linear map to the vocabulary, then softmax
    d.arrow((DEC, decoder_top), (DEC, decoder_top + 0.45), "linear")
    d.box("linear", "Linear", "linear", DEC, decoder_top + 0.45, WIDTH - 0.6, 0.55)
    d.arrow((DEC, decoder_top + 1.0), (DEC, decoder_top + 1.35), "softmax")
    d.box("softmax", "Softmax", "softmax", DEC, decoder_top + 1.35, WIDTH - 0.6, 0.55)
    d.arrow((DEC, decoder_top + 1.9), (DEC, decoder_top + 2.25), "softmax")
    ax.text(DEC, decoder_top + 2.5, "Output Probabilities", ha="center", va="center", fontsize=8.5)

    # the title above the drawing; numbered badges on the noted parts, and the legend in the free
    # space above the encoder, each note wrapped so that it stays clear of the decoder's column
    top = decoder_top + 2.8
    ax.set(xlim=(-0.3, 12.3), ylim=(-0.2, top + (0.9 if title else 0)), aspect="equal")
    if title:
        ax.text(-0.2, top + 0.55, title, ha="left", va="center", fontsize=10, fontweight="bold")
    legend_y = top - 0.3
    for number, (name, text) in enumerate(notes.items(), start=1):
        targets = sorted(_expand([name]) & d.anchors.keys()) or [name]
        for target in targets:
            if target in d.anchors:
                x, y = d.anchors[target]
                ax.add_patch(Circle((x, y), 0.24, facecolor=HIGHLIGHT_EDGE, edgecolor="white", lw=1.0, zorder=6))
                ax.text(x, y, str(number), ha="center", va="center", fontsize=7.5, color="white",
                        fontweight="bold", zorder=7)
        lines = textwrap.wrap(text, LEGEND_CHARS)
        ax.add_patch(Circle((0.2, legend_y - 0.22), 0.22, facecolor=HIGHLIGHT_EDGE, zorder=6))
        ax.text(0.2, legend_y - 0.22, str(number), ha="center", va="center", fontsize=7.5, color="white",
                fontweight="bold", zorder=7)
        ax.text(0.6, legend_y - 0.22 - 0.21 * (len(lines) - 1), "\n".join(lines), ha="left", va="center",
                fontsize=8.5, linespacing=1.15)
        legend_y -= 0.2 + 0.42 * len(lines)
    fig.tight_layout(pad=0.2)
    return fig
