"""The reference encoder. This package's __init__ imports no torch: `model.config` and
`model.mask_kinds` are read by the server, which never imports torch. Import the torch modules
(`model.encoder`, `model.attention`, `model.masks`, `model.pooling`, `model.checkpoint`, `model.hf_bert`)
directly. `model.export_format` (the export directory format) is torch-free too."""
