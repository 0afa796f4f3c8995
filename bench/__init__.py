"""Load-test harness (`ortserve bench`): OpenAI streaming clients, engine-direct driver, figures, JSON reports
and plots. One-off performance investigations live apart, in bench/perf/.

Must not import server/; imports engine/ only in engine_driver.py (engine-direct mode).
"""
