"""Training losses shared by recipes.

- `gan`: hinge and non-saturating ("vanilla") discriminator / generator losses, and taming-transformers' adaptive
  weight that balances the adversarial term against the reconstruction term.
- `perceptual`: an LPIPS-style distance on VGG16 features, loaded only from a local weights file (never downloaded).
"""
