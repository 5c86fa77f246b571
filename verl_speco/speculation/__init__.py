"""When speculation pays: a measured cost model and the batch-size schedule of draft lengths it
plans for vLLM (`cost_model` numerics, `plan` + calibration file, `calibrate` on vLLM, `report`, `cli`)."""
