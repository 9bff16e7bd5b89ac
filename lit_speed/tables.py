"""One compact table at start-up and one at the end (rich), printed on rank zero only."""
from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table
from rich.text import Text


def format_table(title: str, rows: dict[str, str]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, value in rows.items():  # plain text: a value like 'callbacks=[default,x]' is not rich markup
        table.add_row(Text(str(key)), Text(str(value)))
    return table


def format_rate(value: float | None, unit: str) -> str:
    """A throughput with the digits that mean something: ``"12,346 samples/s"``, ``"19.7 tokens/s"``,
    ``"0.0523 samples/s"`` (three significant digits below 100, never ``"0 samples/s"`` for a rate that is not 0)."""
    if value is None:
        return f"n/a {unit}"
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"


@rank_zero_only
def print_table(title: str, rows: dict[str, str]) -> None:
    Console(soft_wrap=True).print(format_table(title, rows))
