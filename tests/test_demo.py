"""The README's first command runs ``python -m dtr.demo``: it must keep working and keep
showing what it claims (same losses as eager, less peak memory, evictions happening)."""

import re

from dtr import demo


def test_demo_matches_eager_with_less_memory(capsys):
    demo.main(["--steps", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+\d+\s+(\S+)\s+(\S+)\s+(True|False)\s", out, re.M)
    assert len(rows) == 2 and all(same == "True" and a == b for a, b, same in rows), out
    eager, ours = map(float, re.search(r"eager ([\d.]+) MiB, dtr ([\d.]+) MiB", out).groups())
    assert ours < 0.75 * eager, out
    evictions = int(re.search(r"evictions=(\d+)", out).group(1))
    assert evictions > 0, out
