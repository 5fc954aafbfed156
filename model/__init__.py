"""The reference encoder, in two halves (this __init__ imports neither, and no torch).

The torch-free contract, read by serve/ (which never imports torch) and export/:
  model.config          EncoderConfig, the one frozen config (model parts and attention plan included)
  model.mask_kinds      the mask kinds and their numpy reference
  model.attention_paths which graph computes which kinds, at what cost and memory (plan-aware)
  model.signature       the graph's inputs and outputs
  model.export_format   the export directory format (metadata.json)
  model.projection      sentence-transformers' Dense layers after pooling, as numpy (served beside the graph)
  model.tasks           metadata.json's "task": what a model with a task head is for, how its logits become scores
  model.text            tokenizer helpers (tokenizers + numpy)

The torch reference modules (import them directly): model.encoder (embeddings, rotary positions,
layers, stack), model.attention (the attention layer and its paths), model.attention_math (the masked
arithmetic it shares with model.long_attention, the long-input custom ops), model.masks, model.pooling,
model.heads (task heads: classification, SPLADE), model.checkpoint (strict loading), model.hf_pretrained
(Hugging Face directories: the shared loader and its registry of families, one module each with its task
heads: model.hf_bert, model.hf_roberta (+ XLM-RoBERTa), model.hf_modernbert, model.hf_mpnet, model.hf_qwen
(Qwen2, Qwen3), model.hf_gemma3, described by model.hf_family), model.hf_heads (what loading a head shares),
model.relative_positions (MPNet's bucketed bias) and model.hf_dense (sentence-transformers Dense modules after
the Pooling).

Imports point one way, torch half -> contract half, with no circle (tests/test_model_halves.py)."""
