"""Every analysis command, as a test runs it on a run directory of some trainer (``{run}``: its path)."""

EVERY_ANALYSIS = [
    ["attribute", "{run}", "--round", "1"],
    ["diagnose", "{run}", "--round", "1"],
    ["timeline", "{run}", "--state-index", "0"],
    ["validate", "{run}", "--round", "1"],
    ["intervene", "{run}", "--rounds", "1", "--eval-episodes", "4"],
    ["explain", "{run}", "--round", "1", "--episodes", "4", "--draws", "2"],
    ["audit", "{run}"],
    ["report", "{run}"],
]
