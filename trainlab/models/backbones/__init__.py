"""Generic image backbones, built by name through `trainlab.models.registry.create_model`.

- `resnet`: torchvision's ResNets (`tv_resnet50`, and `tv_resnet18_cifar` / `tv_resnet_debug` with a CIFAR stem),
  torchvision's key names and initialisation
- `vit`: MoCo v3's Vision Transformer on timm's (`moco_vit_small`, `moco_vit_base`, conv-stem variants, debug)

Every backbone has timm's interface: `forward_features`, `forward_head(x, pre_logits=True)` (the pooled features),
`set_grad_checkpointing(enabled)`.
"""
