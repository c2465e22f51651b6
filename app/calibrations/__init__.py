"""Calibration text uploads (POST /v1/calibrations) for calibrated HIGGS jobs."""
