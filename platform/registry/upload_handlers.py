"""An upload handler that streams every file to a temporary file and stops once the request passes a cap."""

from django.core.files.uploadhandler import TemporaryFileUploadHandler

from registry.errors import UploadTooLarge


class CappedTemporaryFileUploadHandler(TemporaryFileUploadHandler):
    """Never holds an upload in memory; raises `refusal` as soon as all files together exceed `cap` bytes."""

    def __init__(self, request=None, *, cap: int, refusal: UploadTooLarge):
        super().__init__(request)
        self.cap = cap
        self.refusal = refusal
        self.received = 0

    def receive_data_chunk(self, raw_data: bytes, start: int):
        self.received += len(raw_data)
        if self.received > self.cap:
            self.file.close()
            raise self.refusal
        return super().receive_data_chunk(raw_data, start)
