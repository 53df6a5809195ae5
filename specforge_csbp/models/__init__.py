"""Draft models trained by specforge-csbp (DFlash / DFlash2, `models/dflash/`)."""
