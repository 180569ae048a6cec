"""The train node's parts (tasks/train.py is the node and its loop): set-up (train_setup), the node's key
(train_key), checkpoints and the samples rendered during training, several processes (distributed), the
memory preflight and fp8 base, validation loss, LoRA export formats, the stop flag (interrupt).

May import store, data, models, config, runtime, items, and the nodes whose work training repeats (the
samples during training are rendered as the sample node renders them); never tasks.train itself."""
