"""``python -m services.infer``"""

import asyncio
import logging
import os

from services.infer.main import main

asyncio.run(main())
# An image still on an ONNX Runtime thread cannot be interrupted; the batch was handed back
# (not committed) during the drain, so exit now rather than wait for that thread.
logging.shutdown()
os._exit(0)
