"""JUnit XML: one test case per site, so CI dashboards show which layer broke.

A failing site carries the verdict text: the origin's reason, or which origin it propagates
from. Written with the standard library's ElementTree (text escaped for us).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from layerdiff.compare.judge import PASSING
from layerdiff.compare.result import Column, Diff
from layerdiff.outputs import replacing
from layerdiff.report.findings.diff import describe_origin


def write_junit(result: Diff, path: str | os.PathLike, *, suite: str = "layerdiff") -> Path:
    rows = result.rows
    origins = {(o.site, o.step): o for o in result.origins}
    sites = list(dict.fromkeys(rows[Column.SITE]))
    failing = rows[~rows[Column.VERDICT].isin(PASSING)]
    root = ET.Element("testsuites", name=suite)
    test_suite = ET.SubElement(root, "testsuite", name=suite, tests=str(len(sites)),
                               failures=str(failing[Column.SITE].nunique()), errors="0",
                               skipped="0")
    properties = ET.SubElement(test_suite, "properties")
    for name, value in (("reference", str(result.reference)), ("port", str(result.port)),
                        ("verdict", result.verdict)):
        ET.SubElement(properties, "property", name=name, value=value)
    by_site = dict(tuple(failing.groupby("site", sort=False)))
    for site in sites:
        case = ET.SubElement(test_suite, "testcase", classname=suite, name=site)
        bad = by_site.get(site)
        if bad is None:
            continue
        worst = bad.loc[bad[Column.RATIO].fillna(float("inf")).idxmax()]
        origin = origins.get((site, int(worst[Column.STEP])))
        if origin is not None:
            message = f"origin: {describe_origin(origin)}: {origin.reason}"
        else:
            cause = worst[Column.CAUSE] or "an earlier site"
            message = (f"{worst['pass']} {worst['role']} {worst['arg']} out of tolerance "
                       f"({worst['ratio']:.3g}x), propagated from {cause}")
        failure = ET.SubElement(case, "failure", message=message, type=str(worst[Column.STATUS]))
        failure.text = "\n".join(
            f"step {r['step']} {r['pass']} {r['role']} {r['arg']}: ratio {r['ratio']:.3g}, "
            f"max_abs {r['max_abs']:.3g} ({r['tol_source']})" for _, r in bad.iterrows())
    missing = result.unmatched[result.unmatched["side"] == "reference"]
    for site in dict.fromkeys(missing["site"]):
        case = ET.SubElement(test_suite, "testcase", classname=suite, name=site)
        reasons = missing.loc[missing["site"] == site, "reason"]
        ET.SubElement(case, "failure", message=f"not recorded by the port: {reasons.iloc[0]}",
                      type="missing")
    test_suite.set("tests", str(len(test_suite.findall("testcase"))))
    test_suite.set("failures", str(len(test_suite.findall("testcase/failure"))))
    tree = ET.ElementTree(root)
    ET.indent(tree)
    with replacing(path) as temporary:
        tree.write(temporary, encoding="utf-8", xml_declaration=True)
    return Path(path)
