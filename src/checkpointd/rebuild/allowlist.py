"""BUILTIN_ALLOW: the torch classes ``build(allow=...)`` may opt into, by exact path.

Only public classes that build objects: every ``nn.Module``, ``Optimizer`` and
LR scheduler subclass that ``torch.nn``, ``torch.optim``,
``torch.optim.lr_scheduler`` and ``torch.optim.swa_utils`` export (torch 2.13),
named by ``__module__`` and ``__qualname__`` as ``spec()`` records them. No
prefix: a function under ``torch.nn.`` (``torch.nn.init.*``, a private helper
that calls ``importlib.import_module``) is not admitted. Plain strings: importing
this module imports nothing.
"""

from __future__ import annotations

__all__ = ["BUILTIN_ALLOW"]

_CLASSES: dict[str, str] = {
    "torch.nn.modules.activation": (
        "CELU ELU GELU GLU Hardshrink Hardsigmoid Hardswish Hardtanh LeakyReLU "
        "LogSigmoid LogSoftmax Mish MultiheadAttention PReLU RReLU ReLU ReLU6 "
        "SELU SiLU Sigmoid Softmax Softmax2d Softmin Softplus Softshrink "
        "Softsign Tanh Tanhshrink Threshold"
    ),
    "torch.nn.modules.adaptive": "AdaptiveLogSoftmaxWithLoss",
    "torch.nn.modules.batchnorm": (
        "BatchNorm1d BatchNorm2d BatchNorm3d LazyBatchNorm1d LazyBatchNorm2d "
        "LazyBatchNorm3d SyncBatchNorm"
    ),
    "torch.nn.modules.channelshuffle": "ChannelShuffle",
    "torch.nn.modules.container": (
        "Container ModuleDict ModuleList ParameterDict ParameterList Sequential"
    ),
    "torch.nn.modules.conv": (
        "Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d "
        "LazyConv1d LazyConv2d LazyConv3d LazyConvTranspose1d "
        "LazyConvTranspose2d LazyConvTranspose3d"
    ),
    "torch.nn.modules.distance": "CosineSimilarity PairwiseDistance",
    "torch.nn.modules.dropout": (
        "AlphaDropout Dropout Dropout1d Dropout2d Dropout3d FeatureAlphaDropout"
    ),
    "torch.nn.modules.flatten": "Flatten Unflatten",
    "torch.nn.modules.fold": "Fold Unfold",
    "torch.nn.modules.instancenorm": (
        "InstanceNorm1d InstanceNorm2d InstanceNorm3d LazyInstanceNorm1d "
        "LazyInstanceNorm2d LazyInstanceNorm3d"
    ),
    "torch.nn.modules.linear": "Bilinear Identity LazyLinear Linear",
    "torch.nn.modules.loss": (
        "BCELoss BCEWithLogitsLoss CTCLoss CosineEmbeddingLoss CrossEntropyLoss "
        "GaussianNLLLoss HingeEmbeddingLoss HuberLoss KLDivLoss L1Loss "
        "LinearCrossEntropyLoss MSELoss MarginRankingLoss MultiLabelMarginLoss "
        "MultiLabelSoftMarginLoss MultiMarginLoss NLLLoss NLLLoss2d "
        "PoissonNLLLoss SmoothL1Loss SoftMarginLoss TripletMarginLoss "
        "TripletMarginWithDistanceLoss"
    ),
    "torch.nn.modules.module": "Module",
    "torch.nn.modules.normalization": "CrossMapLRN2d GroupNorm LayerNorm LocalResponseNorm RMSNorm",
    "torch.nn.modules.padding": (
        "CircularPad1d CircularPad2d CircularPad3d ConstantPad1d ConstantPad2d "
        "ConstantPad3d ReflectionPad1d ReflectionPad2d ReflectionPad3d "
        "ReplicationPad1d ReplicationPad2d ReplicationPad3d ZeroPad1d ZeroPad2d "
        "ZeroPad3d"
    ),
    "torch.nn.modules.pixelshuffle": "PixelShuffle PixelUnshuffle",
    "torch.nn.modules.pooling": (
        "AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d "
        "AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d AvgPool1d "
        "AvgPool2d AvgPool3d FractionalMaxPool2d FractionalMaxPool3d LPPool1d "
        "LPPool2d LPPool3d MaxPool1d MaxPool2d MaxPool3d MaxUnpool1d "
        "MaxUnpool2d MaxUnpool3d"
    ),
    "torch.nn.modules.rnn": "GRU GRUCell LSTM LSTMCell RNN RNNBase RNNCell RNNCellBase",
    "torch.nn.modules.sparse": "Embedding EmbeddingBag",
    "torch.nn.modules.transformer": (
        "Transformer TransformerDecoder TransformerDecoderLayer "
        "TransformerEncoder TransformerEncoderLayer"
    ),
    "torch.nn.modules.upsampling": "Upsample UpsamplingBilinear2d UpsamplingNearest2d",
    "torch.nn.parallel.data_parallel": "DataParallel",
    "torch.optim": "Adafactor Muon",
    "torch.optim.adadelta": "Adadelta",
    "torch.optim.adagrad": "Adagrad",
    "torch.optim.adam": "Adam",
    "torch.optim.adamax": "Adamax",
    "torch.optim.adamw": "AdamW",
    "torch.optim.asgd": "ASGD",
    "torch.optim.lbfgs": "LBFGS",
    "torch.optim.lr_scheduler": (
        "ChainedScheduler ConstantLR CosineAnnealingLR "
        "CosineAnnealingWarmRestarts CyclicLR ExponentialLR LRScheduler "
        "LambdaLR LinearLR MultiStepLR MultiplicativeLR OneCycleLR PolynomialLR "
        "ReduceLROnPlateau SequentialLR StepLR"
    ),
    "torch.optim.nadam": "NAdam",
    "torch.optim.optimizer": "Optimizer",
    "torch.optim.radam": "RAdam",
    "torch.optim.rmsprop": "RMSprop",
    "torch.optim.rprop": "Rprop",
    "torch.optim.sgd": "SGD",
    "torch.optim.sparse_adam": "SparseAdam",
    "torch.optim.swa_utils": "AveragedModel SWALR",
}

BUILTIN_ALLOW: tuple[str, ...] = tuple(
    f"{module}.{name}" for module, names in _CLASSES.items() for name in names.split()
)
"""Exact import paths (``torch.nn.modules.linear.Linear``...); each admits only itself."""
