"""The alerting rules shipped in examples/prometheus: valid for `promtool check rules`,
and each firing on the series it is for, and only then (`promtool test rules` on
ddtop-alerts.test.yml). Against a real Prometheus and a live run, tests/test_metrics_end.py
(a failed run) and tests/test_metrics_http.py (a hung, silent rank) see them fire."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from promserver import PROMTOOL, RULES, need, quick_rules


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_the_rules_are_valid_and_fire_on_what_they_are_for() -> None:
    need(PROMTOOL)
    checked = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0 and "SUCCESS: 5 rules found" in checked.stdout, (
        checked.stdout + checked.stderr)
    tested = subprocess.run([PROMTOOL, "test", "rules", RULES.with_suffix(".test.yml").name],
                            cwd=RULES.parent, capture_output=True, text=True, timeout=30)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_rule_that_does_not_fire_is_caught(tmp_path: Path) -> None:
    """promtool's test fails where an alert expected does not fire: the one above can."""
    need(PROMTOOL)
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(
        'outcome="failed"', 'outcome="never"'))
    test = RULES.with_suffix(".test.yml")
    (tmp_path / test.name).write_text(test.read_text())
    tested = subprocess.run([PROMTOOL, "test", "rules", test.name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=30)
    assert tested.returncode != 0 and "DdtopRunFailed" in tested.stdout + tested.stderr


def test_quick_rules_cut_only_the_waits(tmp_path: Path) -> None:
    quick = quick_rules(tmp_path).read_text()
    assert "for: 2m" not in quick and quick.count("for: 1s") == RULES.read_text().count("for:")
    assert quick.replace("for: 1s", "") == RULES.read_text().replace(
        "for: 2m", "").replace("for: 10m", "")
