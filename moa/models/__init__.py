"""fairseq models of the moa plugin (fairseq also imports every module here for --user-dir)."""
