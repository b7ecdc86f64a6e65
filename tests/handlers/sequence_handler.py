"""A stateful handler for StreamPredictions2: keeps a running sum per sequence in this worker."""
import os


class SequenceSum:
    def initialize(self, context):
        self.sums = {}

    def handle(self, data, context):
        out = []
        for idx, row in enumerate(data):
            seq = context.get_sequence_id(idx)
            value = int(bytes(row.get("data") or b"0") or b"0")
            self.sums[seq] = self.sums.get(seq, 0) + value
            end = context.get_request_header(idx, "ts_request_sequence_end")
            out.append(f"{seq}:{self.sums[seq]}:{os.getpid()}:{'end' if end == 'true' else ''}")
        return out
