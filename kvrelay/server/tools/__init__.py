"""Tool calling: DeepSeek-V4 chat encoding and the DSML tool-call encoder/parser."""
