"""A scrape's text: metric families (daemon/metrictable.py) written out in Prometheus'
text format 0.0.4 or in OpenMetrics 1.0.0, whichever the scraper's Accept header asks
for (Prometheus asks for OpenMetrics first).

Written here, not by prometheus_client's encoders: theirs make an object and a dict per
sample and format every label of every sample again; at 1,024 ranks (about 50,000
samples) that was 0.4 s of CPU a scrape. Here each rank's labels are escaped and joined
once a scrape, and a sample is one f-string. tests/test_exposition.py holds the text to
prometheus_client's own encoders and parsers (the same families, samples and help).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ddtop.daemon.metrictable import Family

TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def negotiate(accept: str) -> tuple[bool, str]:
    """From a scrape's Accept header: whether to write OpenMetrics, and the content type.
    OpenMetrics where it is asked for in version 1 (or with no version) and not refused
    (q=0), else the text format, which every scraper reads."""
    for offered in (accept or "").split(","):
        media, *params = (part.strip() for part in offered.split(";"))
        if media.lower() != "application/openmetrics-text":
            continue
        given = {name.strip().lower(): value.strip().strip('"')
                 for name, _, value in (p.partition("=") for p in params)}
        if given.get("q", "1").rstrip("0").rstrip(".") in ("0", ""):
            continue  # q=0, q=0.0: not acceptable
        if given.get("version", "1.").startswith("1."):
            return True, OPENMETRICS_TYPE
    return False, TEXT_TYPE


def encode(families: Iterable[Family], openmetrics: bool) -> bytes:
    """The families as a scrape's body, in OpenMetrics or in the text format."""
    out: list[str] = []
    # A family's identity labels (RANK_LABELS' values, the run's) written once a scrape,
    # and the labels samples add (a state, a cause, a bucket's bound) once each.
    written: dict[tuple[str, ...], dict[tuple[str, ...], str]] = {}
    added: dict[tuple[tuple[str, str], ...], str] = {}
    for family in families:
        name, kind = family.name, family.kind
        if openmetrics:
            head, doc = name, _escape(family.doc)
        else:  # the text format names a counter by its samples, and has no info type
            head = name + ("_total" if kind == "counter" else "_info" if kind == "info" else "")
            kind = "gauge" if kind == "info" else kind
            doc = family.doc.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {head} {doc}\n# TYPE {head} {kind}\n")
        names = family.labels
        known = written.setdefault(names, {})
        for suffix, values, more, value in family.samples:
            labels = known.get(values)
            if labels is None:
                labels = known[values] = ",".join(
                    f'{label}="{_escape(text)}"' for label, text in zip(names, values,
                                                                         strict=True))
            if more:
                extra = added.get(more)
                if extra is None:
                    extra = added[more] = ",".join(f'{label}="{_escape(text)}"'
                                                   for label, text in more)
                labels = f"{labels},{extra}" if labels else extra
            # Below a million, repr is the spelling (Prometheus reads "1.0" as 1; NaN
            # fails the test and is spelled by _number).
            number = repr(value) if -1e6 < value < 1e6 else _number(value)
            out.append(f"{name}{suffix}{{{labels}}} {number}\n" if labels
                       else f"{name}{suffix} {number}\n")
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode("utf-8", "replace")


def _escape(text: str) -> str:
    """A label value or OpenMetrics help: backslash, double quote and newline escaped."""
    if "\\" in text or '"' in text or "\n" in text:
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return text


def _number(value: float) -> str:
    """A sample's value as Go (Prometheus) spells it: +Inf, -Inf, NaN, and an exponent
    from 1e+06 up (Python's repr waits until 1e+16)."""
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text
