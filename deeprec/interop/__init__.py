"""Bridges to other recommendation libraries' data types. `deeprec.interop.torchrec`: TorchRec's
KeyedJaggedTensor / KeyedTensor and a drop-in EmbeddingBagCollection (the optional extra
`deeprec[torchrec]`; nothing here imports torchrec until it is used)."""
