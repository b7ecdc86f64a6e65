"""Reports where BaseHandler placed this worker: gpu_id, device and CUDA_VISIBLE_DEVICES."""
import os

from ts.torch_handler.base_handler import BaseHandler


class DeviceReport(BaseHandler):
    def handle(self, data, context):
        return [{"gpu_id": context.system_properties["gpu_id"], "device": str(self.device),
                 "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()} for _ in data]
