"""VAR (Tian et al., 2024): the multi-scale VQVAE tokenizer and the next-scale transformer, one concept a file.

- `vqvae`, `vqvae_blocks`: the tokenizer's encoder / decoder (official `vae_ch160v4096z32` layout)
- `quantizer`, `codebook`: the multi-scale residual quantizer; EMA codebook and dead-code maintenance
- `transformer`, `blocks`: the AdaLN transformer with block-causal attention and a static KV cache
- `convert`: official `.pth` / `.safetensors` in and out, architecture inferred from shapes (`loading`: its former
  name, kept for one release)
- `sample`: the sampling loop (CFG, top-k / top-p, the official random-number order)
"""
