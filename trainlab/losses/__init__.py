"""Training losses shared by recipes.

- `gan`: hinge and non-saturating ("vanilla") discriminator / generator losses, and taming-transformers' adaptive
  weight that balances the adversarial term against the reconstruction term.
- `infonce`: MoCo v3's contrastive loss (InfoNCE x 2T) with keys gathered by an injected function.
- `perceptual`: an LPIPS-style distance on VGG16 features, loaded only from a local weights file (never downloaded).
"""
