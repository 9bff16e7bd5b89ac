"""Reading examples with Hugging Face datasets (lit_speed.sft.loading): every file kind, folders and globs, and one line
naming the file, the line and the setting for what cannot be read."""
from __future__ import annotations

import json
import time

import pytest

from lit_speed.sft import loading
from lit_speed.sft.loading import DataError, is_hub_id, load_records
from tests.helpers.sft import write_jsonl

ROWS = [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(6)]


def write_all_kinds(folder):
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    write_jsonl(folder / "a.jsonl", ROWS)
    (folder / "b.json").write_text(json.dumps(ROWS))
    table.to_parquet(str(folder / "c.parquet"))
    table.to_csv(str(folder / "d.csv"), index=False)
    return folder


@pytest.mark.parametrize("name", ["a.jsonl", "b.json", "c.parquet", "d.csv"])
def test_each_file_kind_loads_the_same_rows(tmp_path, name):
    folder = write_all_kinds(tmp_path)
    records = load_records(str(folder / name), cache_dir=str(tmp_path / "cache"))
    assert records.dataset.to_list() == ROWS and records.parts[0].rows == 6


def test_a_folder_a_glob_and_a_list_concatenate_in_order(tmp_path):
    for i in range(3):
        write_jsonl(tmp_path / "data" / f"part{i}.jsonl", ROWS[2 * i:2 * i + 2])
    (tmp_path / "data" / "notes.txt").write_text("not data")
    for source in (str(tmp_path / "data"), str(tmp_path / "data" / "*.jsonl"),
                   [str(tmp_path / "data" / f"part{i}.jsonl") for i in range(3)]):
        records = load_records(source, cache_dir=str(tmp_path / "cache"))
        assert records.dataset.to_list() == ROWS
    assert records.where(3).endswith("part1.jsonl line 2")


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "q", "completion": \n' + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(DataError, match=rf"^data\.source: {path} line 3 is not a JSON object \(Expecting value\)\. "
                                        r"Fix: correct or remove that line$"):
        load_records(str(path), cache_dir=str(tmp_path / "cache"))
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"line 1 is not a JSON object \(a JSON list, not an object\)"):
        load_records(str(path), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(("source", "message"), [
    ("missing.jsonl", r"data\.source=.*missing\.jsonl: no such file or folder\. Fix: data\.source=<a "),
    ("empty_folder", r"data\.source=.*empty_folder: the folder holds no \.jsonl/\.json/\.parquet/\.csv file"),
    ("*.nothing", r"the pattern matches no file"),
    ("notes.txt", r"\(\.txt\) is not a type datasets reads here"),
    ("mixed", r"one data set of several file types \(\.csv, \.jsonl\)")])
def test_sources_that_are_no_data_set_are_refused_naming_the_setting(tmp_path, source, message):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS)
    (tmp_path / "mixed" / "b.csv").write_text("prompt,completion\nq,a\n")
    with pytest.raises(DataError, match=message):
        load_records(str(tmp_path / source), cache_dir=str(tmp_path / "cache"))


def test_a_dataset_id_without_network_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout=3.0: False)
    assert is_hub_id("tatsu-lab/alpaca") and not is_hub_id(str(tmp_path)) and not is_hub_id("data/*.jsonl")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"data\.source=nobody/no-such-dataset: not a file or folder here; the Hugging "
                                        r"Face Hub cannot be reached \(no network\) and the dataset is not in the "
                                        r"local datasets cache.*Fix: data\.source=<a local"):
        load_records("nobody/no-such-dataset", cache_dir=str(tmp_path / "cache"))
    assert time.perf_counter() - start < 10  # no half-minute of retries


def test_files_with_other_columns_are_refused_together(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "plain"}])
    with pytest.raises(DataError, match=r"the files do not hold the same columns .*a\.jsonl: \['prompt', 'completion'\]"):
        load_records(str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"))
