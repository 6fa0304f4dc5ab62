"""The dashboard's charts, drawn with axes and values (plotext, through textual-plotext).

A Chart displays the ChartData it is handed (series.py builds it): a line plot
with the global step on the x axis, the unit on the y axis and the latest value
in the title. Where it has too little room for axes (a narrow or short
terminal), it draws what the dashboard drew before: the title and a one-row
sparkline.

plotext builds a plot in 5 to 20 milliseconds (in Python, a cell at a time), so
a Chart draws again only when its data or size changed, and keeps what it drew;
the app builds the data every other second (pacing.CHARTS_EVERY_S) and hands it
to one chart a frame (mainpanels.ChartGrid.hand_out).
A series has at most two points per cell of width (a braille cell is two dots
wide): more would cost time and show nothing.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot

from ddtop.core.scalars import compact
from ddtop.dashboard.series import ChartData, Line

# Below this size a chart is a title and a sparkline: axes, ticks and a title
# take seven lines and a dozen columns before the first point.
MIN_PLOT_WIDTH, MIN_PLOT_HEIGHT = 28, 8
LEGEND_MIN_HEIGHT = 12  # a legend sits over the plot: only where it hides little
TICKS = 5  # about this many labelled ticks on an axis (fewer where they would crowd)
BARS = "▁▂▃▄▅▆▇█"
# One color a line, in legend order (plotext's names); the spread's max, median, min.
COLORS = ("cyan", "orange", "green", "magenta", "red", "blue", "yellow", "white")


def thin(line: Line, most: int) -> Line:
    """At most `most` points of `line`, evenly spaced, its last point kept."""
    n = len(line.xs)
    if n <= most or most < 2:
        return line
    picks = sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})
    return Line(line.label, tuple(line.xs[i] for i in picks), tuple(line.ys[i] for i in picks))


def finite(line: Line) -> Line:
    """`line` without its non-finite points (a diverged loss): plotted, they would
    break the axes; the title still says the latest value as it is."""
    if all(math.isfinite(y) for y in line.ys):
        return line
    kept = [(x, y) for x, y in zip(line.xs, line.ys, strict=True) if math.isfinite(y)]
    return Line(line.label, tuple(x for x, _ in kept), tuple(y for _, y in kept))


def nice_ticks(low: float, high: float, most: int = TICKS) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten apart) from `low` to `high`:
    as many as fit in `most` (at least two where the span allows); `low` alone when
    the two are equal."""
    if not high > low:
        return [low]
    power = 10 ** math.floor(math.log10((high - low) / max(1, most)))
    for step in (m * power * scale for scale in (1, 10, 100) for m in (1, 2, 2.5, 5)):
        first = math.ceil(low / step - 1e-9) * step
        ticks = [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]
        if len(ticks) <= most:
            return [round(t, 12) for t in ticks]
    return [low, high]


def sparkline(values: tuple[float, ...], width: int) -> str:
    """`values` as one row of block characters, `width` cells, the newest at the right."""
    values = tuple(v for v in values if math.isfinite(v))
    if not values or width <= 0:
        return ""
    if len(values) > width:  # the mean of each cell's share of the points
        step = len(values) / width
        values = tuple(sum(chunk) / len(chunk) for i in range(width)
                       if (chunk := values[int(i * step):max(int(i * step) + 1,
                                                              int((i + 1) * step))]))
    low, high = min(values), max(values)
    span = high - low
    return "".join(BARS[int((v - low) / span * (len(BARS) - 1)) if span else 0]
                   for v in values)


class Chart(PlotextPlot):
    """A line chart of ChartData: axes and values where there is room, else a sparkline."""

    DEFAULT_CSS = """
    Chart {
        width: 1fr;
        height: 1fr;
    }
    """

    def __init__(self, name: str, unit: str, id: str | None = None) -> None:
        super().__init__(id=id)
        self.data = ChartData(name, unit)
        self.plots = True  # False: always the sparkline (the app's choice)
        self.builds = 0  # plots drawn by plotext, for tests and benchmarks
        self._drawn: tuple[object, Text] | None = None  # (what it was drawn for, the text)

    def set_data(self, data: ChartData) -> bool:
        """Hand the chart its data; it draws again only if the data differ (True)."""
        if data == self.data:
            return False
        self.data = data
        self.refresh()
        return True

    @property
    def is_plot(self) -> bool:
        """Drawn with axes (else as a sparkline) at the current size."""
        width, height = self.size
        return self.plots and width >= MIN_PLOT_WIDTH and height >= MIN_PLOT_HEIGHT

    def render(self) -> RenderResult:
        return self.drawn()

    def drawn(self) -> Text:
        """What the chart shows at its current size: drawn again only when its data
        or size changed."""
        width, height = self.size
        key = (self.data, width, height, self.is_plot)
        if self._drawn is None or self._drawn[0] != key:
            text = self._draw(width, height) if self.is_plot else self._sparkline(width)
            self._drawn = (key, text)
        return self._drawn[1]

    def _sparkline(self, width: int) -> Text:
        text = Text(self.data.short[:width], "dim", no_wrap=True)
        if not self.data.empty:
            text.append("\n" + sparkline(self.data.lines[0].ys, width))
        return text

    @property
    def text(self) -> str:
        """What the chart shows, as plain text (for tests)."""
        return self.drawn().plain

    def _draw(self, width: int, height: int) -> Text:
        """The title (ours: plotext drops a title wider than its canvas), then the plot:
        plotext's axes with our ticks (round numbers, compact labels, whole steps)."""
        data, plt = self.data, self.plt
        words = data.title if len(data.title) <= width else data.short
        title = Text(words[:width], "bold", no_wrap=True)
        lines = [finite(line) for line in data.lines]
        lines = [thin(line, 2 * width) for line in lines if line.xs]
        if not lines:
            return title + Text("\nno data yet", "dim")
        plt.clear_figure()
        plt.plotsize(width, height - 1)
        plt._set_size(width, height - 1)  # as PlotextPlot.render does: plotext needs both
        # No background of its own: the widget's shows through, and a plot without
        # a colour code per cell is parsed by rich in a tenth of the time.
        plt.theme("clear")
        plt.xlabel(data.xlabel)
        plt.ylabel(data.unit)
        legend = len(lines) > 1 and height >= LEGEND_MIN_HEIGHT
        for i, line in enumerate(lines):
            plt.plot(list(line.xs), list(line.ys), marker="braille",
                     color=COLORS[i % len(COLORS)], label=line.label if legend else None)
        xs = [x for line in lines for x in line.xs]
        ys = [y for line in lines for y in line.ys]
        # Whole steps only, and as many labels as fit (a step number takes up to 7 cells).
        xticks = [x for x in nice_ticks(min(xs), max(xs), min(TICKS, width // 9))
                  if x == int(x)]
        plt.xticks(xticks, [str(int(x)) for x in xticks])
        yticks = nice_ticks(min(ys), max(ys), min(TICKS, max(2, (height - 5) // 2)))
        plt.yticks(yticks, [compact(y) for y in yticks])
        self.builds += 1
        return title + "\n" + Text.from_ansi(plt.build(), no_wrap=True)
