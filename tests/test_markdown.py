"""The benchmarks' one markdown table writer: the number rule and the table's lines."""

from benchmarks import markdown as md


def test_number_keeps_significant_figures_and_marks_missing_values():
    assert md.number(None) == "n/a"
    assert md.number(1376.25) == "1376.2"
    assert md.number(44.0) == "44.00"
    assert md.number(0.95912) == "0.959"
    assert md.number(0.95912, digits=2) == "0.96"
    assert md.number(16384) == "16384"
    assert md.number("g") == "g"


def test_table_has_header_separator_and_one_line_per_row():
    lines = md.table(["op", "us", "ratio"], [["fwd", 1219.4, 1.0401], ["dgrad", None, "1.113"]])
    assert lines == [
        "| op | us | ratio |",
        "|---|---|---|",
        "| fwd | 1219.4 | 1.040 |",
        "| dgrad | n/a | 1.113 |",
    ]


def test_dict_table_reads_columns_by_name_and_marks_missing_keys():
    lines = md.dict_table(["T", "new us"], [{"T": 8192, "new us": 12.5, "other": 1}, {"T": 16384}])
    assert lines[2:] == ["| 8192 | 12.50 |", "| 16384 | n/a |"]
