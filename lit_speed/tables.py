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


@rank_zero_only
def print_table(title: str, rows: dict[str, str]) -> None:
    Console(soft_wrap=True).print(format_table(title, rows))
