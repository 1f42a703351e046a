"""A damaged Parquet page (a flipped byte): the rows it holds fail in their places, never with other values, and the
job goes on with the next row group; outputs are written with page CRCs so that their readers can tell the same."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gr_engine.io as gio
from gr_engine import GREngine, RankOutput, RankRequest
from gr_engine.cli import main
from gr_engine.io import open_parquet, read_requests
from gr_engine.output_writer import OutputWriter
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config, with_cache

GROUP_ROWS = 5


def requests() -> list[RankRequest]:
    """15 visits of 5 users: three row groups of five rows."""
    return synthetic_requests(tiny_config().model, 5, 3, first_history=(1, 40), new_events=(0, 8),
                              num_candidates=(1, 6), seed=11)


def column_chunk(path, group: int, column: str) -> range:
    """The byte offsets of ``column``'s chunk in row group ``group`` of the Parquet file ``path``."""
    meta = pq.ParquetFile(path).metadata.row_group(group)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.path_in_schema.split(".")[0] == column:
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            return range(start, start + chunk.total_compressed_size)
    raise KeyError(column)


def flipped(path, offset: int, out):
    """A copy of ``path`` at ``out`` with the byte at ``offset`` flipped."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    out.write_bytes(bytes(data))
    return out


def read_unchecked(path) -> list | None:
    """The rows of ``path`` as pyarrow reads them without checking page CRCs; ``None`` where it fails."""
    try:
        return pq.ParquetFile(path).read().to_pylist()
    except (OSError, pa.ArrowException):
        return None


def silently_wrong_offset(path, group: int, column: str, tmp_path) -> int:
    """An offset in ``column``'s chunk of ``group`` whose flipped byte an unchecked read takes for other values."""
    original = pq.read_table(path).to_pylist()
    for offset in column_chunk(path, group, column):
        read = read_unchecked(flipped(path, offset, tmp_path / "probe.parquet"))
        if read is not None and read != original:
            return offset
    raise AssertionError("no flipped byte reads as other values")


def test_a_damaged_row_group_fails_its_rows_and_the_job_goes_on(tmp_path):
    """A byte of the second row group's item_ids flipped where an unchecked read gives other items: its five rows are
    error rows ``row-6`` .. ``row-10`` saying the group is damaged (they used to be served with the other items, or,
    for a flip the decoder noticed, the job stopped with exit 2 after row 5); rows of the other groups are served and
    equal recompute's scores."""
    stream = requests()
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.Table.from_pylist(msgspec.to_builtins(stream)), clean, row_group_size=GROUP_ROWS,
                   write_page_checksum=True)
    damaged = flipped(clean, silently_wrong_offset(clean, 1, "item_ids", tmp_path), tmp_path / "in.parquet")
    config = tmp_path / "engine.json"
    config.write_text(msgspec.json.encode(tiny_config()).decode())
    out = tmp_path / "out.parquet"
    assert main(["rank", "--input", str(damaged), "--output", str(out), "--config", str(config),
                 "--no-progress"]) == 0
    rows = pq.read_table(out).to_pylist()
    lost = range(GROUP_ROWS, 2 * GROUP_ROWS)
    assert [r["request_id"] for r in rows] == [f"row-{i + 1}" if i in lost else r.request_id
                                               for i, r in enumerate(stream)]
    for i in lost:
        assert rows[i]["user_id"] is None and rows[i]["scores"] == []
        assert rows[i]["error"].startswith(f"row {i + 1} could not be read: row group 1 of the file is damaged")
    kept = [i for i in range(len(stream)) if i not in lost]
    expected = GREngine(with_cache(tiny_config(), mode="recompute")).rank([stream[i] for i in kept], use_tqdm=False)
    for i, exp in zip(kept, expected, strict=True):
        assert rows[i]["error"] is None and rows[i]["user_id"] == exp.user_id
        np.testing.assert_allclose(np.array(rows[i]["scores"]), exp.scores, atol=1e-5)


def small_pages(tmp_path, stream):
    """``stream`` as a checksummed Parquet file of row groups of :data:`GROUP_ROWS` rows and pages of a few values
    (unencoded, so a page's last bytes are its values)."""
    path = tmp_path / "clean.parquet"
    pq.write_table(pa.Table.from_pylist(msgspec.to_builtins(stream)), path, row_group_size=GROUP_ROWS,
                   write_page_checksum=True, data_page_size=32, write_batch_size=1, use_dictionary=False)
    return path


def read_flipped(clean, offset, tmp_path, stream) -> list[int]:
    """The file ``clean`` with the byte at ``offset`` (in its second row group) flipped, read two rows a batch: every
    row is there, in order, those of the other groups unchanged, and the group's failed rows are its last ones, from
    the first failed on, each labelled ``row-N`` and saying why. The rows that failed."""
    parsed = read_requests(flipped(clean, offset, tmp_path / "in.parquet"))
    assert len(parsed) == len(stream), offset
    group = range(GROUP_ROWS, 2 * GROUP_ROWS)
    failed = [i for i, p in enumerate(parsed) if not isinstance(p, RankRequest)]
    assert not failed or (failed[0] in group and failed == list(range(failed[0], group[-1] + 1))), offset
    for i, p in enumerate(parsed):
        if i in failed:
            assert p.request_id == f"row-{i + 1}" and "row group 1 of the file is damaged" in p.error, offset
        elif i not in group:
            assert p == stream[i], (offset, i)
    return failed


@pytest.mark.parametrize("column", ["user_id", "candidate_item_ids"])
def test_a_flipped_byte_fails_a_groups_last_rows_never_others(column, tmp_path, monkeypatch):
    """Every byte of one column chunk of the middle row group flipped in turn: every row is read, the other groups'
    rows unchanged, the failed rows a run ending the group (a page header has no CRC: a flip there may read as
    fewer rows, which fail too, or even shift the group's values, which no reader can tell)."""
    monkeypatch.setattr(gio, "CHUNK_ROWS", 2)  # rows a batch
    stream = requests()
    clean = small_pages(tmp_path, stream)
    assert any([read_flipped(clean, offset, tmp_path, stream) for offset in column_chunk(clean, 1, column)])


@pytest.mark.parametrize("column", ["user_id", "candidate_item_ids"])
def test_a_flipped_value_is_caught_after_the_groups_first_rows_were_read(column, tmp_path, monkeypatch):
    """A byte of the group's last page of values flipped (without the reader's CRC check, each reads as other values):
    the rows read before it are served, the rest of the group fails."""
    monkeypatch.setattr(gio, "CHUNK_ROWS", 2)
    stream = requests()
    clean = small_pages(tmp_path, stream)
    for offset in column_chunk(clean, 1, column)[-8:]:
        failed = read_flipped(clean, offset, tmp_path, stream)
        assert failed and failed[0] > GROUP_ROWS, offset
        parsed = read_requests(tmp_path / "in.parquet")
        assert parsed[GROUP_ROWS:failed[0]] == stream[GROUP_ROWS:failed[0]]


def test_outputs_are_written_with_page_checksums(tmp_path):
    """The last bytes of the scores' column chunk of an output file (the values of its last page) flipped in turn:
    read as file jobs read Parquet, each flip fails the read (without the writer's CRCs each reads as other
    scores)."""
    engine = GREngine(tiny_config())
    path = tmp_path / "out.parquet"
    with OutputWriter(path, RankOutput) as writer:
        writer.write(engine.rank(requests()[:6], use_tqdm=False))
    for offset in column_chunk(path, 0, "scores")[-8:]:
        with open_parquet(flipped(path, offset, tmp_path / "flipped.parquet")) as source, \
                pytest.raises((OSError, pa.ArrowException)):
            source.read(columns=["scores"])


@pytest.mark.parametrize("content", [b"", b"PAR1 not parquet at all", b"x" * 100])
def test_a_file_that_is_not_parquet_is_one_error_naming_it(content, tmp_path, capsys):
    """An empty file, or one whose footer is missing, ends the job before any row with one line naming the file
    (pyarrow's message alone, "Parquet file size is 0 bytes", did not say which)."""
    source = tmp_path / "in.parquet"
    source.write_bytes(content)
    assert main(["rank", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {source} as Parquet: " in err and len(err.strip().splitlines()) == 1, err
