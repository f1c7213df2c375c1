"""Pure `nn.Module` models: the VAR multi-scale VQVAE tokenizer (`vqvae`, `quantizer`, `vqvae_blocks`), and more."""
