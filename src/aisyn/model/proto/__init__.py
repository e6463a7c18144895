"""Generated protobuf module of MindSpore's checkpoint format.

Regenerate with scripts/gen_mindspore_proto.sh.
"""
