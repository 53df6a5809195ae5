"""The layout planner: which DP x CP x mode layout fits a model and context, and how fast it will run.

    pairs.py     exact per-rank rows, shared rows and visible pairs of a layout (from layout/ plans)
    shapes.py    model shapes from a Hugging Face / DFlash config.json
    profile.py   machine profile (measured TFLOP/s, bandwidths, launch overhead) and `calibrate`
    rates.py     calibration of the work a step runs: decoder layer, vocabulary loss, AdamW step
    cost.py      step time and peak memory of one layout
    search.py    every feasible layout, the recommendation, the 8/16-GPU scaling table
"""
