"""JUnit XML of a smoke run, for CI dashboards: per recipe, one `train` test case (the run itself) and one test
case per check; checks of a run that did not finish, and full-run driver checks of a short run, are skipped."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

from gymv.io import atomic_write_text


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_safe(text: str | None) -> str | None:
    """XML 1.0 cannot hold most control characters (a check's text or a crash log may): show them escaped."""
    return None if text is None else _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _sanitize(el: ET.Element) -> None:
    for node in el.iter():
        node.text, node.tail = _xml_safe(node.text), _xml_safe(node.tail)
        for k, v in node.attrib.items():
            node.set(k, _xml_safe(v))


def junit_xml(results, title: str) -> str:
    suite = ET.Element("testsuite", name=f"gymv smoke {title}")
    tests = failures = errors = skipped = 0
    total_time = 0.0
    for r in results:
        classname = r.name
        case = ET.SubElement(suite, "testcase", classname=classname, name="train", time=f"{r.wall_s:.3f}",
                             file=r.recipe)
        tests += 1
        total_time += r.wall_s
        if r.status in ("CRASH", "TIMEOUT", "CONFIG"):
            el = ET.SubElement(case, "error", message=f"{r.status}: {r.reason or ''}", type=r.status.lower())
            el.text = r.log or ""
            errors += 1
        for kind, checks in (("check", r.checks), ("driver check", r.driver_checks)):
            for c in checks:
                tests += 1
                case = ET.SubElement(suite, "testcase", classname=classname, name=f"{kind}: {c.text}", time="0")
                if c.where:
                    case.set("file", c.where.rsplit(":", 1)[0])
                if c.status == "fail":
                    ET.SubElement(case, "failure", message=f"{c.text} is false: {c.observed_text()}", type="check")
                    failures += 1
                elif c.status == "error":
                    ET.SubElement(case, "failure", message=f"{c.text}: {c.error}", type="check-error")
                    failures += 1
                elif c.status == "skip":
                    ET.SubElement(case, "skipped", message=c.error or "skipped")
                    skipped += 1
                else:
                    out = ET.SubElement(case, "system-out")
                    out.text = c.observed_text()
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", str(skipped))
    suite.set("time", f"{total_time:.3f}")
    _sanitize(suite)
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def write_junit(path: str | os.PathLike, results, title: str) -> None:
    atomic_write_text(path, junit_xml(results, title))
