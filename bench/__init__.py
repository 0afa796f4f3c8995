"""Load-test harness: OpenAI streaming clients, engine-direct driver, figures, JSON reports and plots.

Must not import server/; imports engine/ only in engine_driver.py (engine-direct mode).
"""
