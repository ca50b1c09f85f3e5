"""``python -m services.sink``"""

import asyncio

from services.sink.main import main

asyncio.run(main())
