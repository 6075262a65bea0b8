"""`gymv report`: PNG plots and an offline HTML rollout viewer for a finished or running run.

    from gymv.report import build_report
    result = build_report("runs/my-run")          # -> runs/my-run/report/index.html
"""

from gymv.report.build import ReportResult, build_report, default_out_dir
from gymv.report.plots import PLOTS, Plot, write_plots
from gymv.report.run import RunData, read_run, run_signature
from gymv.report.serve import serve_report

__all__ = ["PLOTS", "Plot", "ReportResult", "RunData", "build_report", "default_out_dir", "read_run", "run_signature",
           "serve_report", "write_plots"]
