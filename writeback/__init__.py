"""The write-back engine: persists sealed files to the store, in order."""
