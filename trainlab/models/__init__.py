"""Pure `nn.Module` models: CIFAR VGG / ResNet (`registry`), the PatchGAN discriminator, and the VAR family (`var/`)."""
